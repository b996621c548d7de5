"""EngineStats, a snapshot of an engine: the scheduler's counters, the pool's pages and the KV
tiers' figures, each as its owner reports it (nothing copied field by field), plus what only
the loop knows (failed requests, the queue). Summed over replicas and zeroed here; taken by
the engine loop (``EngineLoop._snapshot``)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import msgspec

from radix import PageStats
from radix.tiers import TierStats
from scheduler.counters import SchedulerCounters


class EngineStats(msgspec.Struct, frozen=True):
    """``counters`` only ever grow (``SchedulerCounters``: requests, prompt/cached/computed/
    generated tokens, evictions, preemptions); ``pages`` are current (``free + cached +
    private == total``; ``private`` is 0 at idle); ``tiers`` are the KV tiers below the pool
    (zeros without them). ``hit_rate`` = cached_tokens / prompt_tokens over the engine's life,
    derived by the counters."""

    counters: SchedulerCounters
    pages: PageStats
    tiers: TierStats
    failed: int
    requests_running: int
    requests_waiting: int
    # Greedy answers cannot depend on the batch or the cache: asked for and verified on this
    # machine (the CPU's probe, the GPU's start-up check). Several engines: all of them.
    batch_invariant: bool = False

    @property
    def hit_rate(self) -> float:
        return self.counters.hit_rate

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for JSON), the derived hit rate included."""
        return {**msgspec.to_builtins(self), "hit_rate": self.hit_rate}

    @classmethod
    def zero(cls) -> EngineStats:
        """An engine that has done nothing and holds nothing (a front before any replica
        reported)."""
        return _zero(cls)

    def retired(self) -> EngineStats:
        """What these stats leave in a sum once their engine is gone (a replica killed or
        replaced): its monotone counts (requests, tokens, failures, the tiers' traffic) and
        nothing it held or measured (pages, tiers' contents, requests in flight, costs)."""
        tiers = _zero(TierStats)
        kept = {name: getattr(self.tiers, name) for name in _TIER_COUNTERS}
        return EngineStats(
            counters=self.counters,
            pages=dataclasses.replace(
                _zero(PageStats), evicted=self.pages.evicted,
                pins_released=self.pages.pins_released,
            ),
            tiers=dataclasses.replace(tiers, **kept),
            failed=self.failed,
            requests_running=0,
            requests_waiting=0,
        )

    @classmethod
    def total(cls, parts: list[EngineStats]) -> EngineStats:
        """Several engines' stats as one's (replicas behind a router): counts add up, measured
        costs (the tiers' seconds per page) are averaged over the engines that have them, and
        the hit rate follows from the summed counters."""
        return _sum(cls, parts) if parts else cls.zero()


# TierStats' monotone counts (the rest is contents now and measured costs).
_TIER_COUNTERS = (
    "written_host", "written_disk", "loaded_host", "loaded_disk", "dropped", "corrupt",
    "disk_write_errors", "skipped_slow",
)


@functools.cache
def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    if dataclasses.is_dataclass(cls):
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return {name: hints[name] for name in cls.__struct_fields__}


def _is_record(kind: Any) -> bool:
    return isinstance(kind, type) and (
        dataclasses.is_dataclass(kind) or issubclass(kind, msgspec.Struct)
    )


def _zero(cls: type) -> Any:
    """``cls`` with every count 0, every optional measurement None, nested records zero."""
    values = {}
    for name, kind in _fields(cls).items():
        if _is_record(kind):
            values[name] = _zero(kind)
        elif kind is bool:
            values[name] = False
        elif kind is int:
            values[name] = 0
        elif kind is float:
            values[name] = 0.0
        elif kind == tuple[int, ...]:  # counts by position
            values[name] = ()
        else:  # float | None: not measured
            values[name] = None
    return cls(**values)


def _sum(cls: type, parts: list[Any]) -> Any:
    values = {}
    for name, kind in _fields(cls).items():
        column = [getattr(part, name) for part in parts]
        if _is_record(kind):
            values[name] = _sum(kind, column)
        elif kind is bool:
            values[name] = all(column)
        elif kind in (int, float):
            values[name] = sum(column)
        elif kind == tuple[int, ...]:  # counts by position: add position by position
            width = max(map(len, column), default=0)
            values[name] = tuple(
                sum(counts[i] for counts in column if i < len(counts)) for i in range(width)
            )
        else:
            present = [v for v in column if v is not None]
            values[name] = sum(present) / len(present) if present else None
    return cls(**values)
