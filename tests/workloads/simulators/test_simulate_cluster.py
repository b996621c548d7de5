"""The cluster simulator: real schedulers behind a router fed by the replicas' KV events."""

from __future__ import annotations

import numpy as np

from cluster import PageTier
from workloads.simulators.cli import main
from workloads.simulators.cluster import POOL_ONLY, simulate_cluster
from workloads.simulators.stats import trace_stats
from workloads.traces.synthetic import SimSession, SimTrace, SimTurn


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 32_000, size=n).tolist()


def small_tenants(seed: int = 0, prompts: int = 6, sessions: int = 48) -> SimTrace:
    """Sessions of 1-2 turns on a few 96-token system prompts, arriving over time; a quarter
    of them in a namespace of their own."""
    rng = np.random.default_rng(seed)
    shared = [_tokens(rng, 96) for _ in range(prompts)]
    out = []
    for i in range(sessions):
        namespace = "tenant-a" if i % 4 == 0 else None
        turns = [SimTurn(_tokens(rng, 12), 8) for _ in range(1 + i % 2)]
        out.append(SimSession(shared[i % prompts], turns, arrival=2 * i, namespace=namespace))
    return SimTrace("small", out)


def test_cache_aware_reaches_the_ideal_on_a_trace_that_fits_and_beats_round_robin() -> None:
    trace = small_tenants()
    stats = trace_stats(trace, 16)
    pages = stats.working_set_pages  # every replica could hold everything
    keep: list[object] = []
    aware = simulate_cluster(trace, "cache_aware", 4, pages, 16, stats, keep=keep)
    rr = simulate_cluster(trace, "round_robin", 4, pages, 16, stats)
    assert aware.requests == rr.requests == trace.num_requests
    assert aware.hit_rate >= rr.hit_rate
    assert aware.hit_rate >= 0.95 * stats.ideal_hit_rate
    assert sum(aware.requests_per_replica) == trace.num_requests

    _, index, replicas, _ = keep
    assert index.num_hashes <= aware.index_max_hashes <= 4 * pages
    for name, sched, _publisher in replicas:
        kv = sched.kv
        tree = {page.key for page in kv.tree.walk_pages()}
        assert index.view(name).hashes == tree  # events caught up with every replica
        page_stats = kv.stats()
        assert page_stats.private == 0
        assert page_stats.free + page_stats.cached == kv.num_pages == pages
        assert len(tree) == page_stats.cached


def test_a_namespaced_copy_of_a_prefix_never_hits_across_namespaces() -> None:
    rng = np.random.default_rng(1)
    sessions = []
    for i in range(6):
        prefix = _tokens(rng, 80)
        user = _tokens(rng, 10)
        for j, namespace in enumerate((None, "a", "b")):
            sessions.append(SimSession(prefix, [SimTurn(user, 4)], 3 * i + j, namespace))
    trace = SimTrace("namespaces", sessions)
    stats = trace_stats(trace, 16)
    assert stats.ideal_cached_tokens == 0
    for router in ("cache_aware", "text_prefix", "round_robin"):
        result = simulate_cluster(trace, router, 2, 64, 16, stats)
        assert result.cached_tokens == 0, router


def test_small_pools_keep_the_index_within_the_replicas_pools(capsys) -> None:
    trace = small_tenants(seed=2, prompts=12)
    stats = trace_stats(trace, 16)
    pages = 2 * stats.largest_request_pages
    keep: list[object] = []
    result = simulate_cluster(trace, "cache_aware", 3, pages, 16, stats, keep=keep)
    assert result.evicted_pages > 0
    assert result.index_max_hashes <= 3 * pages
    _, index, replicas, _ = keep
    for name, sched, _publisher in replicas:
        assert index.view(name).hashes == {p.key for p in sched.kv.tree.walk_pages()}
    main(["--replicas", "2", "--router", "all", "--traces", "shared-prefix", "--capacity", "0.5"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("cache_aware", "text_prefix", "least_loaded"))


def test_the_single_engine_simulators_help_shows_the_cluster_options(capsys) -> None:
    import pytest

    from workloads.simulate import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "--replicas" in text and "--router" in text


def paused_chats(conversations: int = 16, think: int = 150) -> SimTrace:
    """Conversations of three turns on prefixes of their own, arriving every 1-5 steps, the
    user pausing ``think`` steps or up to twice that between turns, so that the others push a
    chat's pages out of the pool meanwhile (and the order of turns is not the order of chats:
    a router blind to where the chats are cannot follow them by luck)."""
    rng = np.random.default_rng(3)
    sessions = []
    arrival = 0
    for _ in range(conversations):
        turns = [
            SimTurn(_tokens(rng, 16), 16, think=int(rng.integers(think, 2 * think)) if t else 0)
            for t in range(3)
        ]
        sessions.append(SimSession(_tokens(rng, 64), turns, arrival=arrival))
        arrival += int(rng.integers(1, 6))
    return SimTrace("paused", sessions)


def test_tier_aware_routing_sends_a_follow_up_to_the_replica_that_wrote_it_down() -> None:
    trace = paused_chats()
    stats = trace_stats(trace, 16)
    pool = 2 * stats.largest_request_pages  # a few chats at a time
    host = stats.working_set_pages  # everything fits below
    results = {}
    for router in ("cache_aware", POOL_ONLY, "least_loaded"):
        keep: list[object] = []
        results[router] = simulate_cluster(
            trace, router, 2, pool, 16, stats, keep=keep, host_pages=host
        )
        routed = keep[3]
        assert len(routed) == results[router].later_requests == 32
    aware, blind, least = results["cache_aware"], results[POOL_ONLY], results["least_loaded"]
    assert aware.loaded_below > 0 and aware.dropped_below == 0
    # Every follow-up whose chat one replica held (in the pool or below) went there...
    assert aware.routing_decisive > 0 and aware.routing_accuracy == 1.0
    # ...and found its history there: the trace hits as one infinite cache would.
    assert aware.hit_ratio > 0.97
    assert aware.later_below_hit_rate > aware.later_pool_hit_rate  # the pauses pushed it down
    for other in (blind, least):
        assert other.routing_accuracy < aware.routing_accuracy
        later = other.later_pool_hit_rate + other.later_below_hit_rate
        assert later < aware.later_pool_hit_rate + aware.later_below_hit_rate


def test_with_tiers_every_page_is_accounted_for_and_the_table_shows_later_turns(capsys) -> None:
    trace = paused_chats(conversations=8, think=60)
    stats = trace_stats(trace, 16)
    keep: list[object] = []
    pool = 2 * stats.largest_request_pages
    result = simulate_cluster(
        trace, "cache_aware", 2, pool, 16, stats, keep=keep, host_pages=6, disk_pages=12
    )
    assert result.written_below > 0 and result.dropped_below > 0
    _, index, replicas, _ = keep
    for name, sched, publisher in replicas:
        view = index.view(name)
        counts = view.tier_counts()
        assert counts[PageTier.DEVICE] == len(list(sched.kv.tree.walk_pages()))
        assert counts == publisher.tier_counts()
        assert counts[PageTier.HOST] + counts[PageTier.DISK] <= 6 + 12
    main([
        "--replicas", "2", "--router", "cache_aware", POOL_ONLY, "--traces", "multi-turn",
        "--capacity", "0.05", "--host-capacity", "0.3",
    ])
    out = capsys.readouterr().out
    assert "tier hit" in out and "to holder" in out and POOL_ONLY in out


def test_a_shared_remote_store_serves_each_prefix_to_every_replica_once_computed() -> None:
    """Pools too small for the trace's system prompts: without a remote store each replica
    computes every prompt it is sent; with one, a prompt computed on any replica is loaded by
    the others, the router (counting the store's pages held by all) still balances, and the
    store's index entries are vouched for by the replicas that announced them."""
    trace = small_tenants(prompts=12, sessions=96)
    stats = trace_stats(trace, 16)
    pool = 3 * stats.largest_request_pages
    results = {}
    for remote in (0, stats.working_set_pages):
        keep: list[object] = []
        results[remote] = simulate_cluster(
            trace, "cache_aware", 2, pool, 16, stats, keep=keep, remote_pages=remote
        )
        _, index, replicas, _ = keep
        index.check()
        shared = set().union(*(publisher.shared() for _, _, publisher in replicas))
        assert index.num_shared == len(shared)
    off, on = results[0], results[stats.working_set_pages]
    assert off.remote_hit_rate == 0 and off.loaded_remote == 0
    assert on.loaded_remote > 0 and on.remote_hit_rate > 0.3
    assert on.hit_rate > off.hit_rate and on.hit_ratio > 0.95
    assert on.imbalance <= off.imbalance + 0.1


def test_the_router_trusts_no_more_store_pages_than_the_store_keeps() -> None:
    """A store of 12 pages (two system prompts) under a trace of 12 prompts: the store's LRU
    evicts without telling anyone, so the index keeps only the 12 pages used last; requests
    sent on the store's word rarely miss, and the hit rate stays that of no store."""
    trace = small_tenants(prompts=12, sessions=96)
    stats = trace_stats(trace, 16)
    pool = 3 * stats.largest_request_pages
    off = simulate_cluster(trace, "cache_aware", 2, pool, 16, stats)
    keep: list[object] = []
    tight = simulate_cluster(trace, "cache_aware", 2, pool, 16, stats, keep=keep,
                             remote_pages=12)
    _, index, replicas, _ = keep
    assert tight.requests == off.requests == trace.num_requests
    assert all(publisher.shared_capacity == 12 for _, _, publisher in replicas)
    assert 0 < index.num_shared <= 12
    assert tight.hit_rate >= 0.98 * off.hit_rate
