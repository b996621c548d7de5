"""What happens around requests: clients that leave, a full queue, the API key, shutdown."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import ServerProcess

CHAT = "/v1/chat/completions"


def long_chat(max_tokens: int = 2000, stream: bool = False) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def content(line: str) -> str:
    """The text a chat SSE line carries ("" for other lines)."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def gauge(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def idle(url: str) -> bool:
    return (
        gauge(url, "radixkv:kv_pages_in_use") == 0
        and gauge(url, "radixkv:num_requests_running") == 0
        and gauge(url, "radixkv:num_requests_waiting") == 0
    )


def test_streaming_client_that_disconnects_frees_its_pages_at_once(server_url: str) -> None:
    aborted = _aborted(server_url)
    with httpx.Client(base_url=server_url, timeout=60) as client:
        with client.stream("POST", CHAT, json=long_chat(stream=True)) as reply:
            lines = reply.iter_lines()
            for line in lines:  # wait for real tokens, then leave mid-stream
                if content(line):
                    break
            assert gauge(server_url, "radixkv:kv_pages_in_use") > 0
    # 2000 tokens would take minutes; the abort takes a step.
    assert wait_until(lambda: idle(server_url), 10), "pages still in use after disconnect"
    # an aborted output is counted by a background task, maybe after its pages are free
    assert wait_until(lambda: _aborted(server_url) == aborted + 1, 10)


def test_non_streaming_client_that_disconnects_frees_its_pages_at_once(server_url: str) -> None:
    aborted = _aborted(server_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server_url + CHAT, json=long_chat(), timeout=httpx.Timeout(60, read=1.5))
    assert wait_until(lambda: idle(server_url), 10), "pages still in use after disconnect"
    # an aborted output is counted by a background task, maybe after its pages are free
    assert wait_until(lambda: _aborted(server_url) == aborted + 1, 10)
    ok = httpx.post(server_url + CHAT, json=long_chat(max_tokens=2), timeout=60)
    assert ok.status_code == 200


def test_a_client_that_leaves_after_one_of_its_choices_finished_counts_every_choice(
    server_url: str,
) -> None:
    """Choice 0 stops at once, choice 1 runs on when the client leaves: one finished, one
    aborted, both counted (the finished output had been taken already; asking its handle
    again waited forever and left both uncounted)."""
    done, aborted = _finished(server_url), _aborted(server_url)
    body = {"prompt": ["The capital of France is Paris. The capital of Germany is", "1, 2, 3,"],
            "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stop": ["Berlin"]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server_url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=3))
    assert wait_until(lambda: idle(server_url), 10), "pages still in use after disconnect"
    assert wait_until(lambda: _finished(server_url) == done + 2, 5), (
        _finished(server_url), done)
    # an aborted output is counted by a background task, maybe after its pages are free
    assert wait_until(lambda: _aborted(server_url) == aborted + 1, 10)


def _finished(url: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "radixkv:request_success_total":
                total += sample.value
    return total


def _aborted(url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if (
                sample.name == "radixkv:request_success_total"
                and sample.labels.get("finished_reason") == "abort"
            ):
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def guarded() -> Any:
    """A second server: an API key, one running request, one waiting, a short grace period,
    the default log level (its access lines). The last test here stops it with SIGTERM."""
    proc = ServerProcess(
        "--num-pages",
        "256",
        "--api-key",
        "sekret",
        "--max-running",
        "1",
        "--max-queued",
        "1",
        "--grace-period",
        "20",
        log_level=None,
    )
    yield proc
    proc.stop()


AUTH = {"Authorization": "Bearer sekret"}


def test_api_key_is_required_on_v1_routes(guarded: ServerProcess) -> None:
    url = guarded.url
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "sekret"},
        {"Authorization": "Bearer s\u00e9kret".encode()},  # non-ASCII: 401, not a 500
    ):
        reply = httpx.get(url + "/v1/models", headers=headers)
        assert reply.status_code == 401
        assert reply.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # probes need no key


def test_full_queue_answers_503_with_retry_after(guarded: ServerProcess) -> None:
    url = guarded.url
    replies: list[httpx.Response] = []

    def send() -> None:
        replies.append(
            httpx.post(url + CHAT, json=long_chat(max_tokens=24), headers=AUTH, timeout=120)
        )

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in replies)
    assert 200 in codes and 503 in codes, codes
    for reply in replies:
        if reply.status_code == 503:
            assert reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "queue_full"
        else:
            assert reply.json()["usage"]["completion_tokens"] == 24
    assert "radixkv:request_rejected_total" in httpx.get(url + "/metrics").text
    assert wait_until(lambda: idle(url), 10)


def test_the_queue_limit_counts_every_completion_a_request_adds(guarded: ServerProcess) -> None:
    """--max-queued 1: two prompts are two engine requests, which can never wait in a queue
    of one (a 400 saying so, not a 503 to retry forever); one prompt is admitted."""
    body = {"prompt": ["Hello", "Bye"], "max_tokens": 2}
    reply = httpx.post(guarded.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"
    assert "--max-queued" in reply.json()["error"]["message"]
    body = {"prompt": "Hello", "max_tokens": 2}
    ok = httpx.post(guarded.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200


def access_lines(server: ServerProcess) -> list[str]:
    return [line for line in server.output().splitlines() if "radixkv.access" in line]


def test_every_request_gets_one_access_line_with_its_status_time_and_tokens_never_its_prompt(
    guarded: ServerProcess,
) -> None:
    """At the default log level: a client's 404s and 401s leave a trace, and a request's
    line counts what its usage says, streamed or not."""
    secret = "the-tenants-secret-prompt"
    before = len(access_lines(guarded))
    assert httpx.get(guarded.url + "/v1/no-such-route", timeout=30).status_code == 404
    body = {"prompt": secret, "max_tokens": 3, "ignore_eos": True}
    url = guarded.url + "/v1/completions"
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    whole = httpx.post(url, json=body, headers=AUTH, timeout=60).json()["usage"]
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 2}
    with httpx.stream("POST", url, json=streamed, headers=AUTH, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert wait_until(lambda: len(access_lines(guarded)) >= before + 4, 10), guarded.output()
    lines = access_lines(guarded)[before:]
    assert len(lines) == 4, lines
    assert "GET /v1/no-such-route 404 " in lines[0]
    assert "POST /v1/completions 401 " in lines[1]
    for line, seen in zip(lines[2:], (whole, usage)):
        assert "POST /v1/completions 200 " in line
        assert line.endswith(
            f"prompt_tokens={seen['prompt_tokens']} completion_tokens={seen['completion_tokens']}"
        ), line
    assert secret not in guarded.output()


def test_a_pool_smaller_than_the_context_bounds_the_default_and_names_the_fields(
    guarded: ServerProcess,
) -> None:
    """256 pages x 16 tokens hold 4,097 tokens of one request (the last is never stored), not
    the model's 8,192: that is the context the server reports, chat's default budget, and a
    request over it is context_length_exceeded naming its fields (was: every chat without
    max_tokens refused, naming "prompt")."""
    url = guarded.url
    [model] = httpx.get(url + "/v1/models", headers=AUTH).json()["data"]
    assert model["max_model_len"] == 256 * 16 + 1
    ask = [{"role": "user", "content": "Say hi."}]
    ok = httpx.post(url + CHAT, json={"messages": ask, "temperature": 0}, headers=AUTH,
                    timeout=120)
    assert ok.status_code == 200, ok.text
    over = httpx.post(url + CHAT, json={"messages": ask, "max_tokens": 5000}, headers=AUTH)
    error = over.json()["error"]
    assert over.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "messages" and "max_tokens" in error["message"]
    assert "4097 tokens" in error["message"]


def test_a_client_gone_during_its_upload_is_not_an_error_in_the_log(
    guarded: ServerProcess,
) -> None:
    host, port = guarded.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer sekret\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\"")
        time.sleep(0.5)
    time.sleep(0.5)
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert "request failed" not in guarded.output()
    assert "ClientDisconnect" not in guarded.output()


def test_an_unusable_kv_disk_dir_is_a_usage_error_not_a_traceback(tmp_path: Any) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--dtype", "float32", "--port", "0",
         "--kv-disk-dir", str(a_file / "below")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "radixkv: error: kv_disk_dir: cannot use" in done.stderr
    assert "Traceback" not in done.stderr


def test_sigterm_stops_accepting_lets_the_stream_in_flight_finish_and_exits_0(
    guarded: ServerProcess,
) -> None:
    url = guarded.url
    received: list[str] = []

    def stream() -> None:
        with httpx.stream(
            "POST",
            url + CHAT,
            json=long_chat(max_tokens=40, stream=True),
            headers=AUTH,
            timeout=120,
        ) as reply:
            received.extend(line for line in reply.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    assert wait_until(lambda: any(content(line) for line in received), 60)
    guarded.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(url + "/health", timeout=2)
    reader.join(60)
    assert guarded.process.wait(60) == 0, guarded.output()
    finals = [line for line in received if '"finish_reason":"length"' in line]
    assert finals, received[-3:]  # the stream ran to its end: 40 tokens, not aborted
    assert received[-1] == "data: [DONE]"


def test_streams_still_running_when_the_grace_period_ends_are_ended_not_cut() -> None:
    """--grace-period 1 and a 2,000-token stream: at the end of the grace the request is
    aborted, and the client still gets a last chunk (finish_reason "abort") and [DONE].
    (At the default log level with ``--log-requests off``: no access line.)"""
    proc = ServerProcess(
        "--num-pages", "256", "--grace-period", "1", "--log-requests", "off", log_level=None
    )
    received: list[str] = []

    def stream() -> None:
        with httpx.stream(
            "POST", proc.url + CHAT, json=long_chat(max_tokens=2000, stream=True), timeout=120
        ) as reply:
            received.extend(line for line in reply.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert wait_until(lambda: any(content(line) for line in received), 60)
        proc.process.send_signal(signal.SIGTERM)
        reader.join(60)
        assert proc.process.wait(60) == 0, proc.output()
    finally:
        proc.stop()
    assert any('"finish_reason":"abort"' in line for line in received), received[-3:]
    assert received[-1] == "data: [DONE]"
    assert "Traceback" not in proc.output()
    assert access_lines(proc) == [] and "Uvicorn running" in proc.output()
