"""The inspector under load: making 20,000 nodes into JSON must not hold the server's event
loop (every stream's next token waits on it), and inspections run one at a time, a few more
waiting, the rest told to retry (429). Through uvicorn in this process, so the loop's own
stalls can be timed; the snapshots are a real engine's, its tree repeated to the largest
budget (what ``create_app(snapshots=)`` takes from replicas)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn

from engine import Engine, SamplingParams
from server import ServerConfig, create_app
from server.inspector.endpoints import MAX_BUDGET, MAX_WAITING_INSPECTIONS


def big_snapshots(engine: Engine) -> Mapping[str, Any]:
    """The engine's real snapshot, its tree's nodes repeated up to ``MAX_BUDGET``."""
    prompts = [f"Load test {i}: the inspector must stay off the loop. Question {i * 7}?"
               for i in range(24)]
    engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0))
    real = engine.inspect(MAX_BUDGET)
    nodes = real.tree.nodes
    assert nodes, "the engine's tree is empty"
    grown: list[Any] = []
    while len(grown) + len(nodes) <= MAX_BUDGET:
        base = len(grown)
        grown.extend(msgspec.structs.replace(n, parent=n.parent + base if n.parent >= 0 else -1)
                     for n in nodes)
    tree = msgspec.structs.replace(real.tree, nodes=grown, total_nodes=len(grown),
                                   budget=MAX_BUDGET)
    return {"engine": msgspec.structs.replace(real, tree=tree)}


class LoopServer:
    """uvicorn on a free loopback port, on an event loop of ours in a thread (``loop``)."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def served(loaded_fp32: Any) -> Iterator[tuple[str, asyncio.AbstractEventLoop]]:
    engine = Engine(model=loaded_fp32, num_pages=256)
    snapshots = big_snapshots(engine)
    server = LoopServer(create_app(engine, ServerConfig(), snapshots=lambda budget: snapshots))
    yield server.url, server.loop
    server.stop()
    engine.close()


def loop_cpu_s(loop: asyncio.AbstractEventLoop) -> float:
    """The CPU time the server's event-loop thread has used so far (read on that thread)."""

    async def now() -> float:
        return time.thread_time()

    return asyncio.run_coroutine_threadsafe(now(), loop).result(10)


def test_twenty_thousand_nodes_are_made_into_json_off_the_event_loop(
    served: tuple[str, Any],
) -> None:
    """CPU time, not wall time, so a busy machine cannot blur it: the loop thread's share of
    an inspection is sending its 4 MB (~20 ms on a 2-core runner), no longer the snapshots'
    walk, the JSON and the full garbage collection 20,000 dicts set off (~190 ms there)."""
    url, loop = served
    httpx.get(url + "/inspect/state?budget=10")  # the first request's one-time costs
    before = loop_cpu_s(loop)
    replies = [httpx.get(url + f"/inspect/state?budget={MAX_BUDGET}", timeout=60)
               for _ in range(3)]
    per_inspection = (loop_cpu_s(loop) - before) / len(replies)
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["replicas"][0]["tree"]["shown"] > MAX_BUDGET // 2
    assert per_inspection < 0.06, (
        f"the event loop spent {1000 * per_inspection:.0f} ms of CPU per inspection"
    )


def test_inspections_run_one_at_a_time_and_the_excess_get_429(served: tuple[str, Any]) -> None:
    url, _ = served
    burst = MAX_WAITING_INSPECTIONS + 6

    def get(_: int) -> httpx.Response:
        return httpx.get(url + f"/inspect/state?budget={MAX_BUDGET}", timeout=120)

    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        replies = list(pool.map(get, range(burst)))
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) <= {200, 429}, statuses
    assert 1 <= statuses.count(200) <= burst - 1, statuses
    busy = next(r for r in replies if r.status_code == 429)
    assert busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "inspector_busy"
