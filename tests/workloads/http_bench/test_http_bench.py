"""serve_bench: the maths and the SSE parsing alone, the driver's fallback for servers that
return no token ids (a stand-in on httpx's MockTransport: no such server runs here), and a
small run against a real ``radixkv serve`` (the ``server_url`` fixture)."""

from __future__ import annotations

import asyncio
import math
import random

import msgspec
import pytest

from workloads.http_bench import bench as serve_bench
from workloads.http_bench import compare as serve_compare
from workloads.http_bench.driver import (
    DONE,
    Client,
    RequestResult,
    RunRecord,
    RunSpec,
    SSEDecoder,
    _Stream,
    httpx,
    parse_event,
    run_salt,
    run_trace,
    session_starts,
)
from workloads.http_bench.report import (
    Stats,
    markdown,
    median_summary,
    meets_slo,
    parse_slo,
    stats,
    summarise,
)
from workloads.traces.generators import generate


def test_sse_decoder_joins_data_lines_and_skips_comments_and_other_fields():
    decoder = SSEDecoder()
    events = [
        decoder.feed(line)
        for line in [
            ": keep-alive",
            "event: completion",
            'data: {"a": 1}',
            "",
            "data:[DONE]",
            "",
            'data: {"b":',
            "data: 2}",
            "",
            "",
        ]
    ]
    assert [e for e in events if e is not None] == ['{"a": 1}', "[DONE]", '{"b":\n2}']
    assert decoder.feed('data: {"c": 3}') is None and decoder.flush() == '{"c": 3}'


def test_parse_event():
    assert parse_event(" [DONE] ") == DONE
    assert parse_event('{"choices": []}') == {"choices": []}
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(ValueError):
            parse_event(bad)


def test_stream_divides_a_chunks_gap_among_its_tokens():
    state = _Stream(started=10.0)
    state.on_chunk({"choices": [{"index": 0, "text": "", "token_ids": []}]}, 10.2)  # no token
    state.on_chunk({"choices": [{"index": 0, "text": "A", "token_ids": [5]}]}, 10.5)
    state.on_chunk({"choices": [{"index": 0, "text": "BC", "token_ids": [6, 7]}]}, 10.9)
    state.on_chunk(
        {"choices": [{"index": 0, "text": "D", "token_ids": [8], "finish_reason": "length"}]}, 11.0
    )
    state.on_chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, 11.1)
    assert state.ttft == pytest.approx(0.5)
    assert state.itl == pytest.approx([0.2, 0.2, 0.1])
    assert state.ids == [5, 6, 7, 8] and state.finish == "length"
    assert state.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    with pytest.raises(ValueError, match="server error"):
        state.on_chunk({"error": {"message": "boom"}}, 11.2)


def test_stats_are_linear_interpolated_percentiles():
    s = stats([4.0, 1.0, 3.0, 2.0])
    assert s.mean == 2.5 and s.p50 == 2.5
    assert s.p90 == pytest.approx(3.7) and s.p99 == pytest.approx(3.97)
    assert stats([]) == Stats()


def _result(
    ttft: float, e2e: float, out: int, cached: int | None = 8, error: str | None = None
) -> RequestResult:
    return RequestResult(
        "s",
        0,
        -1,
        0.0,
        "h",
        16,
        out,
        cached,
        ttft,
        e2e,
        [(e2e - ttft) / max(1, out - 1)] * (out - 1),
        error=error,
    )


def test_tpot_goodput_and_hit_rate():
    fast = _result(0.5, 1.4, 10)  # tpot 0.1
    slow_first = _result(3.0, 3.9, 10)
    slow_decode = _result(0.5, 5.0, 10)  # tpot 0.5
    failed = _result(0.1, 0.2, 2, error="HTTP 500")
    assert fast.tpot_s == pytest.approx(0.1) and _result(0.3, 0.3, 1).tpot_s == 0.0
    slo = parse_slo("ttft=2, tpot=0.2")
    assert slo == {"ttft": 2.0, "tpot": 0.2}
    assert [meets_slo(r, slo) for r in (fast, slow_first, slow_decode, failed)] == [
        True,
        False,
        False,
        False,
    ]
    run = RunRecord(1.0, 0, None, 2.0, [fast, slow_first, slow_decode, failed])
    s = summarise(run, slo)
    assert (s.completed, s.failed) == (3, 1)
    assert s.goodput == pytest.approx(0.5) and s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(15.0)
    assert s.total_token_throughput == pytest.approx((30 + 48) / 2)
    assert s.hit_rate == pytest.approx(24 / 48) and s.errors == ["HTTP 500"]
    assert summarise(run, {}).goodput is None
    unknown = summarise(RunRecord(1.0, 0, None, 1.0, [_result(0.5, 1.4, 10, None)]), slo)
    assert unknown.cached_tokens is None and unknown.hit_rate is None
    assert "unknown" in markdown("x", [unknown], slo)
    for bad in ("ttft", "latency=3", "ttft=0"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_median_over_repeats():
    runs = [
        summarise(RunRecord(2.0, i, 4, d, [_result(t, t + 1, 5)]), {})
        for i, (d, t) in enumerate([(1.0, 0.1), (3.0, 0.3), (2.0, 0.2)])
    ]
    m = median_summary(runs)
    assert m.duration_s == 2.0 and m.ttft.p50 == pytest.approx(0.2) and m.completed == 1
    assert (m.rate, m.max_concurrency) == (2.0, 4)


def test_arrivals_and_rates():
    assert session_starts(3, math.inf, 0) == [0.0, 0.0, 0.0]
    slow, fast = session_starts(5, 1.0, 7), session_starts(5, 4.0, 7)
    assert slow[0] == 0.0 and fast == pytest.approx([t / 4 for t in slow])
    assert serve_bench.parse_rates("0.5, 1,inf") == [0.5, 1.0, math.inf]
    for bad in ("0", "-1", "x"):
        with pytest.raises(ValueError):
            serve_bench.parse_rates(bad)


REPLY = " the answer is"


def _fake_server(tokenizer, with_ids: bool, seen: list[dict]):
    """An OpenAI-style streaming server: every reply is REPLY's tokens, one chunk per token."""
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake"}]})
        body = msgspec.json.decode(request.content)
        seen.append(body)
        lines = []
        for i in reply_ids[: body["max_tokens"]]:
            choice = {"index": 0, "text": tokenizer.decode([i]), "finish_reason": None}
            if with_ids:
                choice["token_ids"] = [i]
            lines.append({"id": "c", "object": "text_completion", "choices": [choice]})
        lines[-1]["choices"][0]["finish_reason"] = "length"
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": len(lines),
            "prompt_tokens_details": {"cached_tokens": 16},
        }
        lines.append({"id": "c", "choices": [], "usage": usage})
        text = "".join(f"data: {msgspec.json.encode(x).decode()}\n\n" for x in lines)
        return httpx.Response(
            200, text=text + "data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
        )

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://fake")


def test_driver_runs_closed_loop_sessions_against_a_server_without_token_ids(tokenizer):
    # Our server always returns token ids (the real-server test below); a server that does
    # not (OpenAI's own, older vLLM) is what this stand-in is for: the re-tokenising fallback.
    with_ids = False
    trace = generate(
        "chat",
        tokenizer,
        0,
        {"users": 2, "turns": 2, "system_tokens": 32, "user_tokens": 8, "max_new_tokens": 3},
    )
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    seen: list[dict] = []
    salt = run_salt(tokenizer, random.Random(1))

    async def go():
        async with _fake_server(tokenizer, with_ids, seen) as http:
            client = Client(http, "fake", tokenizer)
            spec = RunSpec(math.inf, max_concurrency=1, salt=salt)
            return await run_trace(client, trace, spec)

    run = asyncio.run(go())
    assert [(r.session, r.turn) for r in run.requests] == [
        ("user0", 0),
        ("user1", 0),
        ("user0", 1),
        ("user1", 1),
    ]
    assert all(b["ignore_eos"] and b["stream"] and b["return_token_ids"] for b in seen)
    assert all(b["stream_options"] == {"include_usage": True} for b in seen)
    assert all(b["temperature"] == 0 and b["model"] == "fake" for b in seen)
    assert all(b["prompt"][: len(salt)] == list(salt) for b in seen)
    for r in run.requests:
        assert r.ok and r.output_tokens == 3 and r.cached_tokens == 16
        assert r.ttft_s is not None and len(r.itl_s) == 2 and r.output_ids == reply_ids
        assert r.ids_from == ("server" if with_ids else "text")
    by_key = {(r.session, r.turn): body for r, body in zip(run.requests, seen)}
    for user in ("user0", "user1"):  # turn 2 = turn 1's prompt + its reply + the next user turn
        first, second = by_key[(user, 0)]["prompt"], by_key[(user, 1)]["prompt"]
        assert second[: len(first) + 3] == first + reply_ids
    s = summarise(run, {})
    assert s.completed == 4 and s.ids_from == ("server" if with_ids else "text")


def test_against_radixkv_serve(server_url, tmp_path):
    out = tmp_path / "serve.json"
    report = serve_bench.main(
        [
            "--url",
            server_url,
            "--label",
            "radixkv",
            "--workload",
            "chat",
            "--set",
            "users=2",
            "--set",
            "turns=2",
            "--set",
            "system_tokens=64",
            "--set",
            "user_tokens=16",
            "--set",
            "max_new_tokens=4",
            "--request-rate",
            "8,inf",
            "--max-concurrency",
            "2",
            "--slo",
            "ttft=60,tpot=10",
            "--quiet",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ]
    )
    assert report.server.returns_token_ids and report.server.reports_cached_tokens
    assert report.notes == []
    for rate in report.rates:
        s = rate.median
        assert (s.completed, s.failed) == (4, 0) and s.output_tokens == 16
        assert s.ids_from == "server" and s.goodput == pytest.approx(s.request_throughput)
        assert s.hit_rate is not None and s.hit_rate > 0  # turn 2 reuses turn 1
        assert 0 < s.ttft.p50 <= s.e2e.p50
        for r in rate.records[0].requests:
            assert len(r.output_ids) == 4 and len(r.itl_s) == 3
    decoded = msgspec.json.decode(out.read_bytes())
    assert [r["rate"] for r in decoded["rates"]] == [8.0, "inf"]
    assert decoded["rates"][0]["median"] == msgspec.to_builtins(report.rates[0].median)
    assert len(decoded["rates"][1]["records"][0]["requests"]) == 4
    [png] = (tmp_path / "plots").iterdir()
    assert png.read_bytes()[:4] == b"\x89PNG"
    # The side-by-side report reads the same file (twice: two passes of one server).
    table = serve_compare.main(
        [str(out), str(out), "--baseline", "radixkv", "--plot", str(tmp_path / "cmp")]
    )
    assert "### chat, at most 2 in flight" in table
    rows = [line for line in table.splitlines() if "| radixkv |" in line]
    assert len(rows) == 2 and all("| 2 |" in r and r.endswith("| 1.00x | 1.00x |") for r in rows)
    assert (tmp_path / "cmp" / "serve-chat.png").read_bytes()[:4] == b"\x89PNG"
