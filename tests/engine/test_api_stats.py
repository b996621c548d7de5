"""stats(): monotone counters, a hit rate derived from them, and page accounting that adds up."""

from __future__ import annotations

import dataclasses

from engine_helpers import assert_idle_accounting, greedy

from engine.api import EngineStats

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


def test_a_retired_engines_stats_keep_its_counts_and_nothing_it_held(engine) -> None:
    """Replicas summed behind a router: the counts of one that is gone stay in the sum (a
    summed counter never goes down), its pages, contents and requests do not."""
    engine.generate("Count to three.", greedy(4))
    last = engine.stats()
    gone = last.retired()
    assert gone.counters == last.counters and gone.failed == last.failed
    assert gone.pages.total == gone.pages.free == gone.pages.cached == 0
    assert gone.pages.evicted == last.pages.evicted
    assert gone.requests_running == gone.requests_waiting == 0
    assert gone.tiers.host_pages == gone.tiers.disk_bytes == 0
    assert gone.tiers.written_host == last.tiers.written_host
    summed = EngineStats.total([last, gone])
    assert summed.counters.prompt_tokens == 2 * last.counters.prompt_tokens
    assert summed.pages.total == last.pages.total
