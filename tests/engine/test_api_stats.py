"""stats(): monotone counters, a hit rate derived from them, and page accounting that adds up."""

from __future__ import annotations

from engine_helpers import assert_idle_accounting, greedy

from engine.serving.stats import COUNTER_NAMES


def test_counters_only_grow_and_hit_rate_is_derived(engine) -> None:
    prompt = "Counting sheep: one sheep, two sheep, three sheep, four sheep, five sheep, six"
    snapshots = [engine.stats()]
    for _ in range(3):
        engine.generate(prompt, greedy(3))
        snapshots.append(engine.stats())
    for earlier, later in zip(snapshots, snapshots[1:]):
        for name in COUNTER_NAMES:
            assert getattr(later, name) >= getattr(earlier, name), name
        assert later.requests == earlier.requests + 1
        assert later.generated_tokens == earlier.generated_tokens + 3
    last = snapshots[-1]
    assert last.hit_rate == last.cached_tokens / last.prompt_tokens
    assert last.cached_tokens > snapshots[1].cached_tokens  # repeats hit
    assert last.pages_free + last.pages_cached + last.pages_in_use == last.pages_total
    assert set(last.to_dict()) >= set(COUNTER_NAMES) | {"hit_rate", "pages_free"}
    assert_idle_accounting(engine)
