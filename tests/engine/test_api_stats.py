"""stats(): monotone counters, a hit rate derived from them, and page accounting that adds up."""

from __future__ import annotations

import dataclasses

from engine_helpers import assert_idle_accounting, greedy

from engine import EngineStats

COUNTER_NAMES = [f.name for f in dataclasses.fields(EngineStats.zero().counters)]


def test_counters_only_grow_and_hit_rate_is_derived(engine) -> None:
    prompt = "Counting sheep: one sheep, two sheep, three sheep, four sheep, five sheep, six"
    snapshots = [engine.stats()]
    for _ in range(3):
        engine.generate(prompt, greedy(3))
        snapshots.append(engine.stats())
    for earlier, later in zip(snapshots, snapshots[1:]):
        for name in COUNTER_NAMES:
            assert getattr(later.counters, name) >= getattr(earlier.counters, name), name
        assert later.counters.requests == earlier.counters.requests + 1
        assert later.counters.generated_tokens == earlier.counters.generated_tokens + 3
    last = snapshots[-1]
    assert last.hit_rate == last.counters.cached_tokens / last.counters.prompt_tokens
    assert last.counters.cached_tokens > snapshots[1].counters.cached_tokens  # repeats hit
    assert last.pages.free + last.pages.cached + last.pages.private == last.pages.total
    as_dict = last.to_dict()
    assert set(as_dict["counters"]) >= set(COUNTER_NAMES) and "free" in as_dict["pages"]
    assert as_dict["hit_rate"] == last.hit_rate
    assert_idle_accounting(engine)
