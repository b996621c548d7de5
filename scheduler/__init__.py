"""scheduler: what runs next (pure Python, no torch).

Request states, waiting-queue policies (fcfs, lpm, dfs-weight, with in-batch grouping) and the
Scheduler: continuous batching, chunked prefill, admission with a decode reserve, preemption.
"""

from __future__ import annotations

from scheduler.batch import Batch, BatchEntry
from scheduler.config import POLICIES, SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.request import Request, RequestState
from scheduler.scheduler import Scheduler

__all__ = [
    "POLICIES",
    "Batch",
    "BatchEntry",
    "Request",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCounters",
]
