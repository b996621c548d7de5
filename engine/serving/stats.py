"""A snapshot of the engine's counters and page accounting."""

from __future__ import annotations

from typing import Any

import msgspec

from scheduler import Scheduler

# Monotone counters copied from the scheduler (never reset, never overwritten per batch).
COUNTER_NAMES = (
    "requests",
    "finished",
    "aborted",
    "prompt_tokens",
    "cached_tokens",
    "computed_prefill_tokens",
    "generated_tokens",
    "evicted_pages",
    "preemptions",
)


class EngineStats(msgspec.Struct, frozen=True):
    """Counters only ever grow; rates are derived from them; page figures are current values.

    ``hit_rate`` = cached_tokens / prompt_tokens over the engine's life. Pages: ``pages_free``
    (on the free list) + ``pages_cached`` (held by the prefix tree, locked or not) +
    ``pages_in_use`` (private to running requests) == ``pages_total``. At idle
    ``pages_in_use`` is 0.
    """

    requests: int
    finished: int
    aborted: int
    prompt_tokens: int
    cached_tokens: int
    computed_prefill_tokens: int
    generated_tokens: int
    evicted_pages: int
    preemptions: int
    failed: int
    hit_rate: float
    pages_total: int
    pages_free: int
    pages_cached: int
    pages_in_use: int
    requests_running: int
    requests_waiting: int

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def snapshot(scheduler: Scheduler, failed: int) -> EngineStats:
    """Reads the scheduler's counters and the KV manager's pages (call on the loop thread)."""
    counters = scheduler.counters
    values = {name: int(getattr(counters, name)) for name in COUNTER_NAMES}
    pages = scheduler.kv.stats()
    prompt = values["prompt_tokens"]
    return EngineStats(
        **values,
        failed=failed,
        hit_rate=values["cached_tokens"] / prompt if prompt else 0.0,
        pages_total=pages.total,
        pages_free=pages.free,
        pages_cached=pages.cached,
        pages_in_use=pages.private,
        requests_running=scheduler.num_running,
        requests_waiting=scheduler.num_waiting,
    )
