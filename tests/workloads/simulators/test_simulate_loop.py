"""The simulators' one loop: one engine is the cluster's case N = 1."""

from __future__ import annotations

import pytest

from workloads.simulators.cluster import simulate_cluster
from workloads.simulators.one_engine import simulate
from workloads.simulators.stats import pool_pages, trace_stats
from workloads.traces.synthetic import SimSession, SimTrace, SimTurn, multi_turn_chat, shared_prefix


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_one_replica_behind_a_router_runs_exactly_as_one_engine(policy: str) -> None:
    for trace in (
        multi_turn_chat(conversations=5, turns=3, system=48, user=20, reply=8),
        shared_prefix(groups=3, per_group=4, prefix=96, unique=16, reply=8),
    ):
        stats = trace_stats(trace, 16)
        pages = pool_pages(stats, 0.5)
        one = simulate(trace, policy, pages, 16, stats)
        for router in ("cache_aware", "round_robin"):
            cluster = simulate_cluster(trace, router, 1, pages, 16, stats, policy=policy)
            assert cluster.requests_per_replica == [one.requests]
            assert (cluster.prompt_tokens, cluster.cached_tokens, cluster.evicted_pages) == (
                one.prompt_tokens, one.cached_tokens, one.evicted_pages)
            assert cluster.steps >= one.steps  # the makespan counts idle steps too


def test_a_cluster_of_n_replicas_splits_its_pages_evenly() -> None:
    stats = trace_stats(shared_prefix(groups=2, per_group=2, prefix=64, unique=8, reply=4), 16)
    assert pool_pages(stats, 1.0, 1) == pool_pages(stats, 1.0)
    assert pool_pages(stats, 1.0, 4) == max(
        int(stats.working_set_pages / 4), 2 * stats.largest_request_pages)


def test_a_turn_waits_its_think_time_after_the_previous_reply() -> None:
    def chat(think: int) -> SimTrace:
        turns = [SimTurn(list(range(40)), 8), SimTurn(list(range(50, 70)), 8, think=think)]
        return SimTrace("pause", [SimSession([], turns)])

    eager = simulate(chat(0), "lpm", 64, 16)
    paused = simulate(chat(100), "lpm", 64, 16)
    assert paused.requests == eager.requests == 2
    assert paused.steps == eager.steps  # steps that ran: the pause runs nothing
    stats = trace_stats(chat(100), 16)
    cluster = simulate_cluster(chat(100), "cache_aware", 1, 64, 16, stats)
    assert cluster.steps >= eager.steps + 100  # the makespan: the pause is in it
    # the second turn (68 tokens) finds the first's two whole pages (40 + 7 tokens with KV)
    assert cluster.later_requests == 1 and cluster.later_pool_hit_rate == 32 / 68
