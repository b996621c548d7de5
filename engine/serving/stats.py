"""The engine loop's snapshot of its engine as ``EngineStats`` (the record lives in
``engine.api``, where front ends and replicas' callers read it)."""

from __future__ import annotations

import dataclasses
import functools

from engine.api.stats import EngineStats
from radix.tiers import TierStats
from scheduler import Scheduler


def snapshot(scheduler: Scheduler, failed: int) -> EngineStats:
    """Reads the scheduler's counters and the KV manager's pages (call on the loop thread)."""
    tiers = scheduler.kv.tier_stats()
    return EngineStats(
        counters=dataclasses.replace(scheduler.counters),  # a copy: the counters move on
        pages=scheduler.kv.stats(),
        tiers=_no_tiers() if tiers is None else tiers,
        failed=failed,
        requests_running=scheduler.num_running,
        requests_waiting=scheduler.num_waiting,
    )


@functools.cache
def _no_tiers() -> TierStats:
    """Zero tiers (frozen, so one serves every snapshot)."""
    return EngineStats.zero().tiers
