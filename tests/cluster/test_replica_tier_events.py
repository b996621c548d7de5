"""Two real engines (one model, tiny pools over host memory) as replicas: their KV events say
where each page is, a page pushed out of the pool to host memory is reported as moved there,
and the cache-aware router sends a conversation's next turn to the replica that holds it
there rather than to an idle one without it."""

from __future__ import annotations

from typing import Any

import pytest

from cluster import CacheAware, KVEventPublisher, KVIndex, PageTier, RouteRequest
from cluster.events import kv_places
from engine import Engine, SamplingParams

POOL_PAGES = 20  # 320 tokens: about one of the documents below
DOCS = [
    " ".join(f"Record {d}.{i}: the {w} measured {d * 13 + i} units." for i in range(14))
    for d, w in enumerate(["river", "engine", "garden"])
]


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=2, temperature=0.0)


def places(eng: Engine) -> dict[int, PageTier]:
    """What the engine holds, each page at its best place (read at idle)."""
    assert eng.wait_idle(timeout=60)
    return kv_places(eng._loop._kv)


@pytest.fixture
def replicas(loaded_fp32: Any):
    engines = {
        name: Engine(model=loaded_fp32, num_pages=POOL_PAGES, kv_host_bytes=1 << 30)
        for name in ("r0", "r1")
    }
    publishers = {name: KVEventPublisher(name, epoch=1) for name in engines}
    for name, eng in engines.items():
        eng.subscribe_kv(publishers[name].on_event)  # before serving anything
    yield engines, publishers
    for eng in engines.values():
        eng.close()


def test_a_replica_reports_pages_pushed_to_host_memory_and_the_router_follows_them(
    replicas,
) -> None:
    engines, publishers = replicas
    index = KVIndex()
    for publisher in publishers.values():
        index.resync(publisher.snapshot())
    r0 = engines["r0"]
    first = r0.encode(DOCS[0] + "\nQuestion: which record is largest?")
    r0.generate([first], greedy())
    for doc in DOCS[1:]:  # the other documents push the first out of r0's pool
        r0.generate([doc + "\nQuestion: which record is smallest?"], greedy())
    for name, publisher in publishers.items():
        batch = publisher.drain()
        assert batch is None or index.apply(batch)
        view = index.view(name)
        assert {h: view.where(h) for h in view.hashes} == places(engines[name]), name
    counts = index.view("r0").tier_counts()
    stats = r0.stats()
    assert counts[PageTier.HOST] == stats.tiers.host_pages > 0
    assert counts[PageTier.DEVICE] == stats.pages.cached

    follow_up = r0.encode(DOCS[0] + "\nQuestion: which record is largest? And the smallest?")
    policy = CacheAware(index, r0.page_size, pending_ttl_s=0)
    run = policy.prefix_runs(policy.hashes(RouteRequest(follow_up)), ["r0", "r1"])["r0"]
    assert PageTier.HOST in run  # its history is below r0's pool now
    assert policy.choose(RouteRequest(follow_up), {"r0": 2, "r1": 0}) == "r0"
    blind = CacheAware(index, r0.page_size, pending_ttl_s=0, tier_cost=None)
    assert blind.choose(RouteRequest(follow_up), {"r0": 2, "r1": 0}) == "r1"
    out = r0.generate([follow_up], greedy())[0]
    assert r0.stats().counters.cached_tokens_host > 0 and out.cached_tokens > 0
