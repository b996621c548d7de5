"""The remote KV tier in the router's view: the pages a replica knows to be in the shared store
count as held by every replica at the remote cost, a replica takes back what it finds gone,
and a replica that never saw a prompt loads it from a real Redis server."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import KVEventBatch, KVEventPublisher, KVIndex, KVSnapshot, PageTier
from cluster.policy import CacheAware, RouteRequest
from cluster.tier_cost import TierCost
from engine.serving.kv_remote import RedisClient
from radix import KVManager, page_hashes
from radix.tiers import KVTiers, RemoteStore
from tests.cluster.test_kv_events_index import PAGE, BytesPool, run_request
from tests.engine.redis_server import redis_server

R = PageTier.REMOTE
D = PageTier.DEVICE


def test_a_page_in_the_shared_store_is_held_by_every_replica_at_the_remote_cost() -> None:
    index = KVIndex()
    index.resync(KVSnapshot("a", 1, 0, [1, 2], shared=[1, 2, 3]))
    index.resync(KVSnapshot("b", 1, 0, [7]))
    runs = index.prefix_tiers([1, 2, 3, 4], replicas=["c"])
    assert runs == {"a": [D, D, R], "b": [R, R, R], "c": [R, R, R]}
    assert index.prefix_tiers([1, 2, 3, 4], below=False) == {"a": [D, D]}  # blind to tiers
    assert index.apply(KVEventBatch("a", 1, 1, stored=[], removed=[], unshared=[3]))
    assert index.prefix_tiers([1, 2, 3]) == {"a": [D, D, R], "b": [R, R], "c": [R, R]} | {
        "a": [D, D]
    } or index.prefix_tiers([1, 2, 3])["b"] == [R, R]
    index.remove_replica("a")  # the only voucher gone: the store's pages are unknown again
    assert index.prefix_tiers([1, 2, 3]) == {} and index.num_shared == 0
    index.check()


def test_a_remote_page_saves_its_compute_less_the_remote_load() -> None:
    cost = TierCost(host=0.02, disk=0.05, remote=0.1)
    assert cost.saved([D, PageTier.HOST, R, R]) == pytest.approx(1 + 0.98 + 0.9 + 0.9)
    with pytest.raises(ValueError, match="remote: must be in"):
        TierCost(remote=1.0)


def test_the_router_sends_a_document_in_the_shared_store_to_the_idle_replica() -> None:
    tokens = list(range(1, 4 * PAGE + 2))
    chain = page_hashes(tokens[: 4 * PAGE], PAGE)
    index = KVIndex()
    index.resync(KVSnapshot("a", 1, 0, []))
    index.resync(KVSnapshot("b", 1, 0, [], shared=chain))  # b wrote it, then evicted it
    index.resync(KVSnapshot("c", 1, 0, [chain[0]]))  # c holds one page of it itself
    policy = CacheAware(index, PAGE, balance_threshold=100, seed=1)
    loads = {"a": 0, "b": 3, "c": 3}
    runs = policy.prefix_runs(chain, list(loads))
    assert runs == {"a": [R] * 4, "b": [R] * 4, "c": [D] + [R] * 3}
    assert policy.choose(RouteRequest(tokens), {"a": 0, "b": 0, "c": 3}) in {"a", "b"}
    blind = CacheAware(index, PAGE, balance_threshold=100, seed=1, tier_cost=None)
    assert blind.choose(RouteRequest(tokens), loads) == "c"  # one pool page beats nothing


def _replica(url: str, pool_pages: int) -> KVManager:
    store = RemoteStore(RedisClient(url), "model-test")
    return KVManager(pool_pages, PAGE, tiers=KVTiers(BytesPool(), PAGE, remote=store))


def test_replicas_announce_the_shared_pages_and_take_back_what_the_store_lost(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path) as (url, _):
        a, b = _replica(url, pool_pages=16), _replica(url, pool_pages=4)
        publishers = {"a": KVEventPublisher("a", epoch=1), "b": KVEventPublisher("b", epoch=1)}
        publishers["a"].attach(a)
        publishers["b"].attach(b)
        index = KVIndex()
        for publisher in publishers.values():
            index.resync(publisher.snapshot())
        document = list(range(1, 3 * PAGE + 1)) + [0]
        chain = page_hashes(document[: 3 * PAGE], PAGE)
        run_request(a, document)
        assert a.tiers.remote.flush()
        batch = publishers["a"].drain()
        assert batch is not None and set(chain) <= set(batch.shared)
        assert index.apply(batch)
        assert index.prefix_tiers(chain) == {"a": [D, D, D], "b": [R, R, R]}

        run_request(b, document)  # b never saw it: loaded from Redis
        assert b.tiers.stats().loaded_remote == 3
        batch = publishers["b"].drain()
        assert batch is not None and set(chain) <= set(batch.stored) & set(batch.shared)
        assert index.apply(batch)

        run_request(b, list(range(50, 50 + 3 * PAGE)) + [0])  # pushes the document out of b
        assert not set(chain) & {page.key for page in b.tree.walk_pages()}
        assert index.apply(publishers["b"].drain())
        RedisClient(url)._redis.flushall()  # the store's policy dropped everything
        handle = b.acquire(document)
        b.load(handle, document)  # asks the store: known pages found missing are taken back
        batch = publishers["b"].drain()
        assert batch is not None and set(chain) <= set(batch.unshared)
        assert index.apply(batch)
        assert index.view("b").shared.isdisjoint(chain)
        index.check()
        b.release(handle)
        for kv in (a, b):
            kv.tiers.close()
