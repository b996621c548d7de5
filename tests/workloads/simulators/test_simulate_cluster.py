"""The cluster simulator: real schedulers behind a router fed by the replicas' KV events."""

from __future__ import annotations

import numpy as np

from workloads.simulators.cli import main
from workloads.simulators.cluster import simulate_cluster
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

    _, index, replicas = keep
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
    _, index, replicas = keep
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
