"""scheduler: what runs next (pure Python, no torch).

SamplingParams (what a request asks for), request states, waiting-queue policies (fcfs, lpm, dfs-weight, with in-batch grouping) and the
Scheduler: continuous batching, chunked prefill, admission with a decode reserve, preemption,
and speculative decoding from the radix tree (speculation/: drafter, what to guess; gate, how
many guesses a step verifies).
"""

from __future__ import annotations

from scheduler.batch import Batch, BatchEntry
from scheduler.config import POLICIES, SCHEDULING_POLICIES, SPECULATION, SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.params import SamplingParams, StructuredOutputsParams
from scheduler.request import Request, RequestState
from scheduler.scheduler import Scheduler

__all__ = [
    "POLICIES",
    "SCHEDULING_POLICIES",
    "SPECULATION",
    "Batch",
    "BatchEntry",
    "Request",
    "RequestState",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCounters",
    "StructuredOutputsParams",
]
