"""The front end's sum of its replicas' stats: counters never go down, whichever replicas
leave (killed, replaced, a restarting hub that forgets them all) and come back."""

from __future__ import annotations

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cluster.replica_stats import ReplicaStats
from engine.api import EngineStats

NAMES = ["a", "b", "c"]


def stats(requests: int, pages: int) -> EngineStats:
    zero = EngineStats.zero()
    return EngineStats(
        counters=dataclasses.replace(zero.counters, requests=requests, prompt_tokens=7 * requests),
        pages=dataclasses.replace(zero.pages, total=pages, free=pages),
        tiers=zero.tiers,
        failed=requests // 3,
        requests_running=1,
        requests_waiting=0,
    )


class ReplicaStatsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sums = ReplicaStats()
        self.counts = dict.fromkeys(NAMES, 0)  # each replica's own counter (monotone)
        self.reporting: set[str] = set()
        self.last_total = 0
        self.last_failed = 0

    @rule(name=st.sampled_from(NAMES), served=st.integers(0, 5))
    def serve(self, name: str, served: int) -> None:
        self.counts[name] += served

    @rule(name=st.sampled_from(NAMES))
    def joins_or_returns(self, name: str) -> None:
        self.reporting.add(name)

    @rule(name=st.sampled_from(NAMES))
    def leaves(self, name: str) -> None:
        self.reporting.discard(name)

    @rule()
    def hub_restarts(self) -> None:
        self.sums.update({})  # a new hub has heard from nobody yet

    @rule()
    def report(self) -> None:
        self.sums.update({n: stats(self.counts[n], 64) for n in sorted(self.reporting)})

    @invariant()
    def counters_only_grow_and_gauges_are_the_live_ones(self) -> None:
        total = self.sums.total()
        if total is None:
            assert self.last_total == 0
            return
        assert total.counters.requests >= self.last_total
        assert total.failed >= self.last_failed
        assert total.counters.prompt_tokens == 7 * total.counters.requests
        self.last_total, self.last_failed = total.counters.requests, total.failed
        assert total.pages.total == 64 * len(self.sums.live)
        assert total.requests_running == len(self.sums.live)


ReplicaStatsMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
TestReplicaStatsMachine = ReplicaStatsMachine.TestCase


def test_a_replica_back_after_leaving_is_counted_once() -> None:
    sums = ReplicaStats()
    sums.update({"a": stats(10, 64), "b": stats(5, 64)})
    sums.update({"a": stats(12, 64)})  # b left: its 5 stay
    assert sums.total().counters.requests == 17 and sums.total().pages.total == 64
    sums.update({"a": stats(12, 64), "b": stats(6, 64)})  # b back (a silence, not a death)
    assert sums.total().counters.requests == 18 and sums.total().pages.total == 128
