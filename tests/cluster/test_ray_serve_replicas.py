"""``radixkv serve --replicas 2`` for real: a local Ray cluster, two engine replicas (one
core each, small KV pools) behind the cache-aware router, the OpenAI API over HTTP.

Skipped with a message where Ray is not installed or cannot start; CI installs it."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import socket
import time
import uuid
from typing import Any

import httpx
import pytest

from engine import Engine, SamplingParams
from tests.server_process import ServerProcess

ray = pytest.importorskip("ray", reason="Ray is not installed (make setup installs ray[serve])")
openai = pytest.importorskip("openai")

SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in one short sentence, name "
    "the aisle when you know it, and say so plainly when you do not know the answer."
)


@pytest.fixture(scope="module")
def cluster() -> Any:
    try:
        server = ServerProcess(
            "--replicas",
            "2",
            "--threads",
            "1",
            "--num-pages",
            "96",
            "--max-running",
            "8",
            module="cluster.cli",
            ready_timeout=240.0,
        )
    except RuntimeError as exc:
        pytest.skip(f"Ray Serve could not start here: {str(exc)[-2000:]}")
    yield server
    assert server.stop(timeout=90) == 0, server.output()[-3000:]


@pytest.fixture(scope="module")
def cluster_url(cluster: ServerProcess) -> str:
    return cluster.url


@pytest.fixture(scope="module")
def client(cluster_url: str) -> Any:
    return openai.OpenAI(base_url=cluster_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def local(loaded_fp32: Any) -> Any:
    with Engine(model=loaded_fp32, num_pages=256) as eng:
        yield eng


def replicas(url: str) -> dict[str, dict[str, Any]]:
    return httpx.get(url + "/v1/replicas", timeout=10).json()


def _deployed(server: ServerProcess, timeout: float = 240.0) -> None:
    """Wait for the whole application: /health answers once the front is up, the engine
    replicas (each starting its own servers as it initialises) come up after it."""
    deadline = time.monotonic() + timeout
    while "replicas x 1 threads" not in server.output():
        assert time.monotonic() < deadline, server.output()[-2000:]
        time.sleep(0.2)


def test_no_process_of_the_local_ray_cluster_listens_beyond_loopback(
    cluster: ServerProcess,
) -> None:
    """Ray has no authentication: GCS, raylet, Serve's controller, proxy and replicas,
    workers and agents of the cluster ``serve --replicas`` starts must not be reachable from
    another machine, on any port, IPv4 or IPv6. (Each Serve replica's inter-deployment gRPC
    server was on ``[::]``, as Ray Serve binds it.)"""
    import psutil

    _deployed(cluster)
    root = psutil.Process(cluster.process.pid)
    processes = [root, *root.children(recursive=True)]
    names = [p.name() for p in processes]
    assert sum(n.startswith("ray::ServeRepli") for n in names) == 3, names  # front + 2
    listening = []
    for process in processes:
        for c in process.net_connections(kind="inet"):  # tcp, tcp6, udp, udp6
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                listening.append((process.name(), process.pid, c.laddr.ip, c.laddr.port))
    assert len(listening) >= 3  # the HTTP port, GCS, the raylet at least

    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return (mapped or address).is_loopback

    exposed = [entry for entry in listening if not loopback(entry[2])]
    assert exposed == []


def test_greedy_answers_do_not_depend_on_the_replica(
    client: Any, local: Engine, cluster_url: str
) -> None:
    questions = [f"Where would I find item number {i} of {uuid.uuid4().hex[:6]}?" for i in range(8)]

    def ask(question: str) -> str:
        reply = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=question, max_tokens=12, temperature=0
        )
        return reply.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # concurrent: both replicas busy
        texts = list(pool.map(ask, questions))
    expected = local.generate(questions, SamplingParams(max_new_tokens=12, temperature=0))
    assert texts == [output.text for output in expected]


def test_both_replicas_serve_and_a_shared_prefix_stays_on_one(
    client: Any, cluster_url: str
) -> None:
    tenant = uuid.uuid4().hex  # a fresh cache salt: nothing cached yet
    cached = []
    for i in range(4):
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Do you sell size {i} hex keys?"},
            ],
            max_tokens=4,
            temperature=0,
            extra_body={"cache_salt": tenant},
        )
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        time.sleep(0.2)  # let the replica's KV events reach the router
    assert cached[0] == 0
    assert all(c >= 48 for c in cached[1:]), cached  # the system prompt's pages, every time

    # Both serve under load: a burst of 12 requests long enough to overlap puts more than the
    # balance threshold (4) in one replica's queue, so the router must use the other. (Four
    # sequential requests of one prefix rightly stay on one replica; a short burst may too,
    # when the replicas finish each request before the next arrives.)
    def ask(i: int) -> int:
        reply = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=f"List {i} tools for a {uuid.uuid4().hex[:8]} project:",
            max_tokens=48,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert list(pool.map(ask, range(12))) == [48] * 12
    assert all(s["counters"]["requests"] > 0 for s in replicas(cluster_url).values())


def test_stored_conversations_continue_on_the_replica_that_holds_them(
    client: Any, cluster_url: str
) -> None:
    """/v1/responses in front of replicas: the front keeps the conversations; each follow-up
    (previous_response_id) starts with its conversation's tokens, so the router sends it to
    the replica that ran the earlier turns (and pinned them there), and it hits."""
    tenant = uuid.uuid4().hex
    talks = []
    for topic in ("paint rollers", "garden hoses", "drill bits", "door hinges"):
        first = client.responses.create(
            input=f"{SYSTEM} Tell me about {topic} in two sentences.", max_output_tokens=12,
            temperature=0, extra_body={"cache_salt": tenant},
        )
        talks.append(first)
    time.sleep(0.5)  # the replicas' KV events reach the router
    follows = []
    for first in talks:
        follow = client.responses.create(
            input="And the price?", previous_response_id=first.id, max_output_tokens=4,
            temperature=0, extra_body={"cache_salt": tenant},
        )
        held = (first.usage.input_tokens + first.usage.output_tokens - 1) // 16 * 16
        assert follow.usage.input_tokens_details.cached_tokens >= held, (first.usage, follow.usage)
        follows.append(follow)

    # Deleting a stored turn ends its pin on the replica that holds it (the unpin is routed
    # by the turn's tokens, as the turn was), not at its TTL.
    def pins() -> int:
        return sum(s["pages"]["pins"] for s in replicas(cluster_url).values())

    time.sleep(1.0)  # the replicas report their stats every 0.5 s
    before = pins()
    for follow in follows:
        client.responses.delete(follow.id, extra_query={"cache_salt": tenant})
    deadline = time.monotonic() + 15
    while pins() > before - len(follows) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert pins() == before - len(follows), (before, pins())


def test_bad_input_is_a_400_naming_the_field(cluster_url: str) -> None:
    reply = httpx.post(
        cluster_url + "/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "temperature": -1},
        timeout=30,
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "temperature" in error["message"] and error["type"] == "invalid_request_error"
    reply = httpx.post(
        cluster_url + "/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 10**6},
        timeout=30,
    )
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"


def test_the_inspector_shows_one_column_per_replica_and_where_requests_went(
    cluster_url: str,
) -> None:
    for i in range(3):
        reply = httpx.post(cluster_url + "/v1/completions", timeout=120, json={
            "prompt": f"{SYSTEM} Question {i}: where are the hammers?", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    # The first read asks the replicas for snapshots; they post them within a second or two.
    deadline = time.monotonic() + 60
    while True:
        body = httpx.get(cluster_url + "/inspect/state", timeout=30).json()
        if len(body["replicas"]) == 2:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    names = {r["name"] for r in body["replicas"]}
    assert names == set(replicas(cluster_url))
    assert any(r["tree"]["total_nodes"] > 0 for r in body["replicas"])  # one prefix: one replica
    # the requests, each with the replica that served it; tenants' text stays hidden (no
    # salt was sent)
    assert {r["replica"] for r in body["routes"]} <= names
    mine = [r for r in body["routes"] if r["label"] and "careful assistant" in r["label"]]
    assert len(mine) >= 3, body["routes"]
    # The totals come from the replicas' snapshots, /v1/replicas from their stats (published
    # every 0.5 s, later under load): compare once both have caught up with the same requests.
    deadline = time.monotonic() + 20
    while body["totals"]["requests"] != sum(
        s["counters"]["requests"] for s in replicas(cluster_url).values()
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
        body = httpx.get(cluster_url + "/inspect/state", timeout=30).json()
    assert body["totals"]["requests"] == sum(
        s["counters"]["requests"] for s in replicas(cluster_url).values())
    assert all(r["label"] is None for r in body["routes"] if r["namespace"] != "default")


def test_every_page_is_accounted_for_after_a_client_leaves_mid_stream(
    client: Any, cluster_url: str
) -> None:
    aborted_before = sum(s["counters"]["aborted"] for s in replicas(cluster_url).values())
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Tell me a very long story about a lighthouse",
        max_tokens=300,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},  # it must still be running when the client leaves
    )
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while True:
        stats = replicas(cluster_url)
        idle = all(
            s["requests_running"] == 0 and s["requests_waiting"] == 0 and s["pages"]["private"] == 0
            for s in stats.values()
        )
        aborted = sum(s["counters"]["aborted"] for s in stats.values()) > aborted_before
        if (idle and aborted) or time.monotonic() > deadline:  # stats arrive every 0.5 s
            break
        time.sleep(0.5)
    assert len(stats) == 2
    assert sum(s["counters"]["aborted"] for s in stats.values()) == aborted_before + 1  # not run to the end
    for s in stats.values():
        assert s["pages"]["free"] + s["pages"]["cached"] == s["pages"]["total"], s
        assert s["requests_running"] == 0 and s["pages"]["private"] == 0, s


def _counter(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _ray_process(cluster: ServerProcess, title: str) -> Any:
    import psutil

    found = [
        p for p in psutil.Process(cluster.process.pid).children(recursive=True)
        if title in " ".join(p.cmdline())
    ]
    assert found, f"no process {title!r} in the cluster"
    return found[0]


def test_counters_never_go_down_when_a_replica_dies_and_a_killed_hub_comes_back(
    client: Any, cluster: ServerProcess, cluster_url: str
) -> None:
    """SIGKILL one replica: what it counted stays in /metrics' sums (Prometheus reads a drop
    as a counter reset). SIGKILL the KV event hub: Ray restarts it and the stats move again.
    Runs last on this cluster: Serve is still replacing the replica afterwards."""
    name = "radixkv:prompt_tokens_total"

    def ask(text: str) -> None:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=text, max_tokens=2)

    for k in range(4):
        ask(f"Question {k}: which aisle has the paint?")
    deadline = time.monotonic() + 30
    while len(replicas(cluster_url)) < 2 or any(
        s["counters"]["requests"] == 0 for s in replicas(cluster_url).values()
    ):  # both replicas counted something (the shared prefix may keep all on one)
        ask(f"{uuid.uuid4().hex} is a code; what is it for?")
        assert time.monotonic() < deadline, replicas(cluster_url)
    seen = [_counter(cluster_url, name)]
    before = set(replicas(cluster_url))
    _ray_process(cluster, "EngineReplica").kill()
    deadline = time.monotonic() + 60
    while set(replicas(cluster_url)) >= before:  # until the dead one is dropped
        seen.append(_counter(cluster_url, name))
        assert time.monotonic() < deadline, replicas(cluster_url)
        time.sleep(0.5)
    seen.append(_counter(cluster_url, name))
    assert seen == sorted(seen) and seen[-1] >= seen[0] > 0, seen

    _ray_process(cluster, "EventHub").kill()
    time.sleep(2)
    deadline = time.monotonic() + 60
    while _counter(cluster_url, name) <= seen[-1]:  # stats flow again through a new hub
        try:
            ask("After the restart: where are the hammers?")
        except openai.APIError:
            pass  # a request routed to the killed replica before Serve noticed
        assert time.monotonic() < deadline, "the stats stopped after the hub was killed"
        time.sleep(1)
    assert _counter(cluster_url, name) > seen[-1]


def test_a_stop_right_after_start_up_exits_cleanly_and_leaves_no_process() -> None:
    """SIGTERM the moment /health first answers (start-up may still be finishing): exit 0,
    and every process the cluster started (raylet, GCS, agents, workers) is gone."""
    import psutil

    try:
        server = ServerProcess(
            "--replicas", "1", "--threads", "1", "--num-pages", "64",
            module="cluster.cli", ready_timeout=240.0,
        )
    except RuntimeError as exc:
        pytest.skip(f"Ray Serve could not start here: {str(exc)[-2000:]}")
    root = psutil.Process(server.process.pid)
    started = root.children(recursive=True)
    server.process.send_signal(15)
    assert server.process.wait(120) == 0, server.output()[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.is_running() for p in started):
        time.sleep(0.5)
    left = [p.name() for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], left


SHORT, LONG = 12, 2000  # max_tokens of the two streams the SIGTERM test holds open


def test_sigterm_refuses_new_requests_lets_short_streams_finish_and_ends_long_ones() -> None:
    """As one engine's server: after SIGTERM new requests get a 503, a stream that ends
    within --grace-period runs to its end, one that does not gets a last chunk
    (finish_reason "abort") and [DONE]; exit 0. Serve's own shutdown cut them all."""
    import threading

    try:
        server = ServerProcess(
            "--replicas", "2", "--threads", "1", "--num-pages", "160", "--grace-period", "8",
            module="cluster.cli", ready_timeout=240.0,
        )
    except RuntimeError as exc:
        pytest.skip(f"Ray Serve could not start here: {str(exc)[-2000:]}")
    # Short: a few tokens, done within the grace period even beside busy processes (20 tokens
    # in 4 s were not, under load). Long: more than the fastest host decodes in it.
    received: dict[int, list[str]] = {SHORT: [], LONG: []}

    def stream(max_tokens: int) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"A story, part {max_tokens}:",
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            received[max_tokens].extend(line for line in r.iter_lines() if line)

    readers = [threading.Thread(target=stream, args=(n,)) for n in received]
    try:
        deadline = time.monotonic() + 120  # /health answers before start-up is over
        while "replicas x 1 threads" not in server.output():
            assert time.monotonic() < deadline, server.output()[-2000:]
            time.sleep(0.2)
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 120
        while not all(len(lines) >= 2 for lines in received.values()):
            assert time.monotonic() < deadline, received
            time.sleep(0.05)
        server.process.send_signal(15)
        refused = None
        for _ in range(40):  # the signal reaches the front within a moment
            reply = httpx.post(server.url + "/v1/completions", timeout=30,
                               json={"prompt": "late", "max_tokens": 2})
            if reply.status_code == 503:
                refused = reply
                break
            time.sleep(0.1)
        assert refused is not None and refused.json()["error"]["code"] == "shutting_down"
        for reader in readers:
            reader.join(90)
        assert server.process.wait(120) == 0, server.output()[-3000:]
    finally:
        if server.process.poll() is None:
            server.stop(timeout=90)
    short, long = received[SHORT], received[LONG]
    assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in short[-2], short[-3:]
    assert long[-1] == "data: [DONE]" and '"finish_reason":"abort"' in long[-2], long[-3:]


def test_replicas_each_keep_a_disk_tier_of_their_own_and_follow_ups_find_it(
    tmp_path: Any,
) -> None:
    """--kv-disk-dir with replicas: each claims its own store under the folder with its share
    of the budget; conversations pushed out of the small pools go down to disk, and each
    follow-up is routed to the replica whose disk holds it (the tier-aware router) and hits."""
    try:
        server = ServerProcess(
            "--replicas", "2", "--threads", "1", "--num-pages", "24",
            "--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-bytes", "64M",
            module="cluster.cli", ready_timeout=240.0,
        )
    except RuntimeError as exc:
        pytest.skip(f"Ray Serve could not start here: {str(exc)[-2000:]}")
    try:
        _deployed(server)
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        tenant = uuid.uuid4().hex
        opened = []
        topics = ("ladders", "sandpaper", "light bulbs", "padlocks", "tape measures", "glue",
                  "hinges", "drill bits", "paint rollers", "garden hoses")
        for topic in topics:  # ~10 pages each: the two 24-page pools cannot hold them all
            opened.append(api.responses.create(
                input=f"{SYSTEM} Describe {topic} for a beginner in two sentences: what they "
                "are for, which kinds there are, how to pick one, what they cost, how long "
                f"they last and what to avoid. Customer note {uuid.uuid4().hex}: the customer "
                f"is new to home repair and asks about {topic} at the front desk today.",
                max_output_tokens=8, temperature=0, extra_body={"cache_salt": tenant},
            ))
        time.sleep(1.0)  # the replicas' KV events (and tier changes) reach the router
        stats = replicas(server.url)
        assert len(stats) == 2
        budgets = [s["tiers"]["disk_budget_bytes"] for s in stats.values()]
        assert budgets == [32 << 20] * 2, budgets  # 64M shared, not 64M each
        assert sum(s["tiers"]["written_disk"] for s in stats.values()) > 0, stats
        hits = []
        for first in opened:
            follow = api.responses.create(
                input="Which one first?", previous_response_id=first.id, max_output_tokens=2,
                temperature=0, extra_body={"cache_salt": tenant},
            )
            held = (first.usage.input_tokens + first.usage.output_tokens - 1) // 16 * 16
            hits.append((follow.usage.input_tokens_details.cached_tokens, held))
        assert all(cached >= held for cached, held in hits), hits  # the whole first turn
        stats = replicas(server.url)
        assert sum(s["tiers"]["loaded_disk"] for s in stats.values()) > 0, stats
        assert sorted(p.name for p in (tmp_path / "kv").iterdir() if p.is_dir()) == [
            "replica-0", "replica-1",
        ]
    finally:
        assert server.stop(timeout=90) == 0, server.output()[-3000:]


def test_replicas_share_one_remote_tier_and_answer_as_one_engine(
    tmp_path: Any, local: Engine
) -> None:
    """--kv-remote with replicas: every replica reads and writes one Redis server, so a
    document one replica computed is loaded by the other when the router (which counts the
    store's pages held by every replica) sends it there, and the answers stay greedy's."""
    from tests.engine.redis_server import redis_server

    with redis_server(tmp_path) as (redis_url, _):
        try:
            server = ServerProcess(
                "--replicas", "2", "--threads", "1", "--num-pages", "96",
                "--kv-remote", redis_url, module="cluster.cli", ready_timeout=240.0,
            )
        except RuntimeError as exc:
            pytest.skip(f"Ray Serve could not start here: {str(exc)[-2000:]}")
        try:
            _deployed(server)
            api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            document = " ".join(
                f"Aisle {i} holds {item}." for i, item in enumerate(
                    ("hammers", "nails", "screws", "glue", "paint", "brushes", "rope", "chain",
                     "locks", "hinges", "tape", "wire", "pipes", "valves", "bulbs", "fuses") * 3
                )
            )
            # One question, then two at once: the router sends the first of those to the
            # replica holding the document and the second to the other (a shorter queue,
            # within the store's cost of the holder), which loads it from Redis. A router
            # blind to the store keeps all three on the holder (under its balance threshold,
            # and too few for a hot prefix's copy).
            prompts = [f"{SYSTEM}\n{document}\nQuestion {q}: where is item {q}?" for q in range(3)]

            def ask(prompt: str) -> tuple[str, int]:
                reply = api.completions.create(
                    model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0
                )
                return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens

            first = ask(prompts[0])
            time.sleep(1.0)  # the remote writes and the KV events reach the router
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                rest = list(pool.map(ask, prompts[1:]))
            texts = [text for text, _ in [first, *rest]]
            cached = [hit for _, hit in [first, *rest]]
            expected = local.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))
            assert texts == [output.text for output in expected]
            assert cached[0] == 0 and all(c >= 160 for c in cached[1:]), cached
            stats = replicas(server.url)
            assert all(s["counters"]["requests"] > 0 for s in stats.values()), stats
            assert sum(s["tiers"]["loaded_remote"] for s in stats.values()) > 0, stats
        finally:
            assert server.stop(timeout=90) == 0, server.output()[-3000:]
