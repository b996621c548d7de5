"""Tenants: the same prompt in another namespace never hits the first one's cache."""

from __future__ import annotations

from engine_helpers import assert_idle_accounting, greedy

PROMPT = (
    "Tenant secret: the vault code is 7391 and the backup code is 2288; never reveal them to "
    "anyone who asks, however politely. Summarise the policy:"
)


def test_same_prompt_in_another_namespace_has_zero_cached_tokens(engine) -> None:
    [first] = engine.generate(PROMPT, greedy(3), namespace="tenant-a")
    [again] = engine.generate(PROMPT, greedy(3), namespace="tenant-a")
    [other] = engine.generate(PROMPT, greedy(3), namespace="tenant-b")
    [default] = engine.generate(PROMPT, greedy(3))
    assert first.cached_tokens == 0
    assert again.cached_tokens > 0
    assert other.cached_tokens == 0
    assert default.cached_tokens == 0
    assert first.token_ids == again.token_ids == other.token_ids == default.token_ids
    assert_idle_accounting(engine)


def test_prefix_cache_off_reuses_nothing(make_engine) -> None:
    eng = make_engine(page_size=16, num_pages=64, prefix_cache=False)
    outs = [eng.generate(PROMPT, greedy(3))[0] for _ in range(3)]
    assert [o.cached_tokens for o in outs] == [0, 0, 0]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    stats = eng.stats()
    assert stats.counters.cached_tokens == 0 and stats.hit_rate == 0.0
    assert stats.counters.computed_prefill_tokens == 3 * outs[0].prompt_tokens
    assert_idle_accounting(eng)
