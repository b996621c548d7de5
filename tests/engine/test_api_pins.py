"""Pins through the engine: a pinned conversation survives other traffic filling the pool and
its next turn hits; pins end by ``unpin``, their lifetime and the budget; ``submit(pin_ttl=)``
pins a finished request's prompt and output; every page is accounted for at idle."""

from __future__ import annotations

import time

import pytest
from engine_helpers import assert_idle_accounting, greedy

from engine import Engine

PAGE = 16
POOL_PAGES = 24  # 384 tokens: one conversation (~130) plus the filler traffic cannot fit
CONVERSATION = " ".join(f"Note {i}: the lantern by door {i} burns {i * 7} hours." for i in range(9))
FILLERS = [
    " ".join(f"Filler {d}.{i} says {w} {i * 3}." for i in range(12))
    for d, w in enumerate(["oak", "elm", "ash", "yew"])
]


def second_turn_hit(eng: Engine, pin_first: bool) -> int:
    """Run the conversation's first turn, then filler traffic that overflows the pool, then
    the second turn (the first turn's prompt extended); the second turn's cached tokens."""
    first = eng.generate(CONVERSATION, greedy(4))[0]
    pin = eng.pin(CONVERSATION, ttl=60.0) if pin_first else None
    for filler in FILLERS:
        eng.generate(filler, greedy(2))
    second = eng.generate(CONVERSATION + first.text + " And door 3?", greedy(2))[0]
    if pin is not None:
        pin.unpin()
    eng.wait_idle(10)
    assert_idle_accounting(eng)
    return second.cached_tokens


def test_a_pinned_prefix_survives_traffic_that_fills_the_pool(make_engine) -> None:
    unpinned = second_turn_hit(make_engine(page_size=PAGE, num_pages=POOL_PAGES), False)
    pinned = second_turn_hit(make_engine(page_size=PAGE, num_pages=POOL_PAGES), True)
    assert unpinned == 0, "without a pin the fillers should have evicted the conversation"
    assert pinned >= 96, f"the pinned conversation should hit, got {pinned} cached tokens"


def test_a_pin_reports_what_it_holds_and_unpin_releases_it(make_engine) -> None:
    eng = make_engine(page_size=PAGE, num_pages=POOL_PAGES)
    eng.generate(CONVERSATION, greedy(1))
    with eng.pin(CONVERSATION, ttl=60.0) as pin:
        assert pin.tokens >= 96 and pin.tokens % PAGE == 0
        assert pin.active
        stats = eng.stats()  # the loop published after taking the pin
        assert stats.pages.pins == 1 and stats.pages.pinned == pin.tokens // PAGE
    assert not pin.active
    eng.generate("anything", greedy(1))  # a step publishes fresh stats
    eng.wait_idle(10)
    assert eng.stats().pages.pins == 0
    assert_idle_accounting(eng)


def test_pinning_what_was_never_cached_pins_nothing(make_engine) -> None:
    eng = make_engine(page_size=PAGE, num_pages=POOL_PAGES)
    pin = eng.pin("never seen before", ttl=60.0)
    assert pin.tokens == 0 and not pin.active
    pin.unpin()  # nothing to do, no error


def test_a_pin_ends_with_its_lifetime_even_when_the_engine_is_idle(make_engine) -> None:
    eng = make_engine(page_size=PAGE, num_pages=POOL_PAGES)
    eng.generate(CONVERSATION, greedy(1))
    pin = eng.pin(CONVERSATION, ttl=0.3)
    assert pin.tokens > 0
    deadline = time.monotonic() + 10
    while eng.stats().pages.pins and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.stats().pages.pins == 0, "the idle loop should have ended the expired pin"
    assert_idle_accounting(eng)


def test_pins_stay_within_the_budget_oldest_released_first(make_engine) -> None:
    # 24 pages x 0.25 = 6 pinned pages at most: the conversation (~8 pages) alone is over.
    eng = make_engine(page_size=PAGE, num_pages=POOL_PAGES, max_pinned_fraction=0.25)
    short = [f"Short text {i} about {w}, kept for a while." * 3 for i, w in enumerate("ab")]
    for text in short:
        eng.generate(text, greedy(1))
    pins = [eng.pin(text, ttl=60.0) for text in short]
    assert all(p.tokens > 0 for p in pins)
    eng.generate(CONVERSATION, greedy(1))
    eng.pin(CONVERSATION, ttl=60.0)
    eng.generate("a step to publish", greedy(1))
    stats = eng.stats()
    assert stats.pages.pinned <= 6, stats.pages
    assert_idle_accounting(eng)


def test_submit_with_pin_ttl_keeps_the_finished_conversation_warm(make_engine) -> None:
    eng = make_engine(page_size=PAGE, num_pages=POOL_PAGES)
    first = eng.submit(CONVERSATION, greedy(4), pin_ttl=60.0).result()
    eng.generate("publish", greedy(1))
    assert eng.stats().pages.pins == 1
    for filler in FILLERS:
        eng.generate(filler, greedy(2))
    second = eng.generate(CONVERSATION + first.text + " And door 3?", greedy(2))[0]
    assert second.cached_tokens >= 96
    assert_idle_accounting(eng)


def test_pins_give_way_to_a_request_that_cannot_fit_beside_them(make_engine) -> None:
    eng = make_engine(page_size=PAGE, num_pages=POOL_PAGES, max_pinned_fraction=0.5)
    eng.generate(CONVERSATION, greedy(1))
    assert eng.pin(CONVERSATION, ttl=60.0).tokens > 0
    long_prompt = " ".join(f"Line {i} of a long report." for i in range(40))  # ~20 pages
    [out] = eng.generate(long_prompt, greedy(2))
    assert len(out.token_ids) == 2
    assert eng.stats().pages.pins == 0
    assert_idle_accounting(eng)


@pytest.mark.parametrize("ttl", [0, -1.0, float("inf"), float("nan"), "60", True])
def test_a_bad_ttl_is_a_value_error_naming_it(make_engine, ttl) -> None:
    eng = make_engine(page_size=PAGE, num_pages=POOL_PAGES)
    with pytest.raises(ValueError, match="ttl"):
        eng.pin("text", ttl=ttl)
    with pytest.raises(ValueError, match="ttl"):
        eng.submit("text", greedy(1), pin_ttl=ttl)


def test_a_bad_max_pinned_fraction_is_a_value_error_naming_it(make_engine) -> None:
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        make_engine(num_pages=8, max_pinned_fraction=1.5)
