"""fork(): the prefix is computed once however many continuations share it."""

from __future__ import annotations

from engine_helpers import assert_idle_accounting, greedy

PREFIX = (
    "The following is a long shared document that every branch of an agent reads before it "
    "acts. It describes a warehouse with shelves of numbered boxes, a loading dock on the "
    "north side, a small office with two desks, and a yard where trucks park overnight. "
    "Each box holds spare parts for bicycles: chains, gears, brake pads, spokes, tyres and "
    "inner tubes, sorted by size. The manager checks the inventory every Monday morning and "
    "orders new stock when a shelf is less than half full. "
)
SUFFIXES = [f"Question {i}: what is in box number {i * 7}?" for i in range(8)]


def test_fork_with_eight_suffixes_computes_prefix_once(make_engine, tokenizer, hf_greedy) -> None:
    eng = make_engine(page_size=16, num_pages=128)
    prefix_ids = tokenizer.encode(PREFIX)
    suffix_ids = [tokenizer.encode(s, add_special_tokens=False) for s in SUFFIXES]
    assert len(prefix_ids) >= 96  # six whole pages

    before = eng.stats()
    outs = eng.fork(PREFIX, SUFFIXES, greedy(4))
    after = eng.stats()

    assert len(outs) == len(SUFFIXES)
    computed = after.counters.computed_prefill_tokens - before.counters.computed_prefill_tokens
    tails = sum(len(s) for s in suffix_ids)
    # Once: the prefix, every suffix, and at most one partial page per branch recomputed.
    assert computed <= len(prefix_ids) + tails + len(SUFFIXES) * eng.page_size
    # Computing the prefix per branch would cost 8x; sharing must save most of it.
    assert computed < 2 * len(prefix_ids) + tails
    shared = len(prefix_ids) // eng.page_size * eng.page_size
    assert sum(o.cached_tokens >= shared for o in outs) >= len(SUFFIXES) - 1
    for out, tail in zip(outs, suffix_ids):
        assert out.prompt_tokens == len(prefix_ids) + len(tail)
        assert out.token_ids == hf_greedy(prefix_ids + tail, 4)
    assert_idle_accounting(eng)
