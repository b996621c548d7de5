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
    "cached_tokens_host",
    "cached_tokens_disk",
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
    ``pages_in_use`` is 0. ``cached_tokens`` counts prompt tokens served from the pool and
    loaded back from host memory (``cached_tokens_host``) or disk (``cached_tokens_disk``).
    """

    requests: int
    finished: int
    aborted: int
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_host: int
    cached_tokens_disk: int
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
    # KV tiers below the pool (all 0 without them): what each holds now, pages written down
    # and loaded back, pages that fell off the bottom, damaged disk files found, loads
    # refused as slower than recomputing, and the measured costs that decide (s per page).
    kv_host_pages: int = 0
    kv_host_bytes: int = 0
    kv_disk_pages: int = 0
    kv_disk_bytes: int = 0
    kv_pages_written_host: int = 0
    kv_pages_written_disk: int = 0
    kv_pages_loaded_host: int = 0
    kv_pages_loaded_disk: int = 0
    kv_pages_dropped: int = 0
    kv_disk_corrupt: int = 0
    kv_disk_write_errors: int = 0
    kv_loads_skipped_slow: int = 0
    kv_load_s_per_page_host: float | None = None
    kv_load_s_per_page_disk: float | None = None
    kv_compute_s_per_page: float | None = None

    @property
    def cached_tokens_pool(self) -> int:
        """Prompt tokens served from the pool's tree (the rest of cached_tokens was loaded)."""
        return self.cached_tokens - self.cached_tokens_host - self.cached_tokens_disk

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def snapshot(scheduler: Scheduler, failed: int) -> EngineStats:
    """Reads the scheduler's counters and the KV manager's pages (call on the loop thread)."""
    counters = scheduler.counters
    values = {name: int(getattr(counters, name)) for name in COUNTER_NAMES}
    pages = scheduler.kv.stats()
    prompt = values["prompt_tokens"]
    tiers = scheduler.kv.tier_stats()
    tier_values = {} if tiers is None else {
        "kv_host_pages": tiers.host_pages,
        "kv_host_bytes": tiers.host_bytes,
        "kv_disk_pages": tiers.disk_pages,
        "kv_disk_bytes": tiers.disk_bytes,
        "kv_pages_written_host": tiers.written_host,
        "kv_pages_written_disk": tiers.written_disk,
        "kv_pages_loaded_host": tiers.loaded_host,
        "kv_pages_loaded_disk": tiers.loaded_disk,
        "kv_pages_dropped": tiers.dropped,
        "kv_disk_corrupt": tiers.corrupt,
        "kv_disk_write_errors": tiers.disk_write_errors,
        "kv_loads_skipped_slow": tiers.skipped_slow,
        "kv_load_s_per_page_host": tiers.load_s_per_page_host,
        "kv_load_s_per_page_disk": tiers.load_s_per_page_disk,
        "kv_compute_s_per_page": tiers.compute_s_per_page,
    }
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
        **tier_values,
    )
