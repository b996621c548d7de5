"""Window slots (radix/window.py) under the KV manager: hits cut back to where the window still
has its KV, slots held while a request may read them, given up oldest first, tails last; a
hypothesis state machine drives requests as the scheduler does (slide, allocate, cache,
release) and checks that every slot is in one place and every readable page has one."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from radix import CacheHandle, KVManager
from radix.window import WindowSlots

PAGE = 2
WINDOW = 4  # tokens: a query reads its own page and at most two before it


def _manager(num_pages: int = 16, slots: int = 6, prefix_cache: bool = True) -> KVManager:
    return KVManager(
        num_pages, PAGE, prefix_cache, window=WindowSlots(num_pages, slots, WINDOW, PAGE)
    )


def _run(kv: KVManager, tokens: list[int], chunk: int = 4) -> CacheHandle:
    """A request as the scheduler runs it: from its cached prefix, ``chunk`` tokens a step."""
    handle = kv.acquire(tokens)
    done = handle.cached_len
    while done < len(tokens):
        kv.slide(handle, done)
        n = min(chunk, len(tokens) - done)
        assert kv.allocate(handle, done + n)
        done += n
    return handle


def _readable(kv: KVManager, handle: CacheHandle, query_pos: int) -> bool:
    window = kv.window
    assert window is not None
    first = window.first_needed(query_pos)
    return all(window.slot_of[page] >= 0 for page in handle.pages[first:])


def test_window_slots_refuse_a_pool_that_cannot_hold_one_window() -> None:
    with pytest.raises(ValueError, match="window_pages: 3 window slots"):
        WindowSlots(16, 3, WINDOW, PAGE)
    with pytest.raises(ValueError, match="tiers"):
        KVManager(16, PAGE, window=WindowSlots(16, 5, WINDOW, PAGE), tiers=object())  # type: ignore[arg-type]


def test_a_long_request_holds_only_its_window() -> None:
    kv = _manager(num_pages=16, slots=5)
    handle = _run(kv, list(range(1, 31)))  # 15 pages through 5 slots
    assert len(handle.pages) == 15
    assert _readable(kv, handle, 30)
    assert kv.stats().window_reclaimed > 0
    kv.release(handle, list(range(1, 31)))
    kv.check([])


def test_a_hit_is_cut_back_to_where_the_window_still_has_its_kv() -> None:
    kv = _manager(num_pages=32, slots=6)
    first = list(range(1, 21))  # 10 pages
    kv.release(_run(kv, first), first)
    again = kv.acquire(first + [99, 98])
    assert again.cached_len == 20  # the window before the end kept its slots (a tail)
    assert _readable(kv, again, 20)
    kv.release(again)
    other = list(range(100, 124))  # 12 more pages: every slot not a tail is reclaimed first
    kv.release(_run(kv, other), other)
    middle = kv.acquire(first[:12] + [7, 7])
    # pages 0-5 lost their slots to ``other``: the prefix of 12 tokens is not usable, nor
    # any shorter one but the empty prefix
    assert middle.cached_len == 0
    kv.release(middle)
    kv.check([])


def test_the_window_before_a_hit_outlives_the_pages_a_request_slid_past() -> None:
    kv = _manager(num_pages=40, slots=14)
    system = list(range(1, 13))  # 6 pages, then two different questions
    first = system + list(range(50, 62))
    kv.release(_run(kv, first), first)
    second = system + list(range(70, 82))
    handle = _run(kv, second)
    assert handle.cached_len == 12  # hit at the fork: the window before it had its slots
    kv.release(handle, second)
    reclaimed = kv.stats().window_reclaimed
    filler = list(range(200, 214))  # 7 pages: the slots inside sequences go first
    kv.release(_run(kv, filler), filler)
    assert kv.stats().window_reclaimed >= reclaimed + 4
    third = kv.acquire(system + [5, 5, 5])
    assert third.cached_len == 12  # the fork's window, a tail, outlived the slid-past pages
    kv.release(third)
    kv.check([])


def test_a_fork_nobody_hit_before_is_cut_back_to_the_last_checkpoint() -> None:
    kv = _manager(num_pages=40, slots=10)
    window = kv.window
    assert window is not None and window.checkpoint == 16  # four windows of 4 tokens
    first = list(range(1, 41))  # 20 pages through 10 slots
    kv.release(_run(kv, first), first)
    assert kv.stats().window_reclaimed > 0
    fork = kv.acquire(first[:22] + [9, 9])
    assert fork.cached_len == 16  # the window before 22 is gone; before 16 it was kept
    kv.release(fork)
    kv.check([])


def test_computing_a_prefix_again_gives_the_tree_its_window_kv_back() -> None:
    kv = _manager(num_pages=32, slots=6)
    first = list(range(1, 17))
    kv.release(_run(kv, first), first)
    for start in (100, 200, 300):  # three more sequences' tails push the first one's out
        filler = list(range(start, start + 8))
        kv.release(_run(kv, filler), filler)
    handle = _run(kv, first + [3, 3])
    assert handle.cached_len < 16  # cut back: recomputed
    kv.release(handle, first + [3, 3])
    again = kv.acquire(first + [4, 4])
    assert again.cached_len == 16  # the recomputed window went to the tree's pages
    kv.release(again)
    kv.check([])


STEMS = [list(range(1, 17)), list(range(1, 9)) + list(range(40, 48)), list(range(60, 76))]


class WindowSlotsMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.kv = _manager(num_pages=20, slots=7)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.live: dict[int, CacheHandle] = {}

    @rule(target=handles, stem=st.integers(0, len(STEMS) - 1), cut=st.integers(0, 16),
          tail=st.lists(st.integers(1, 3), max_size=6), namespace=st.sampled_from([None, "b"]))
    def acquire(self, stem: int, cut: int, tail: list[int], namespace: str | None) -> CacheHandle:
        tokens = STEMS[stem][:cut] + tail or [1]
        matched = self.kv.match(tokens, namespace)
        handle = self.kv.acquire(tokens, namespace)
        window = self.kv.window
        assert window is not None
        assert handle.cached_len == window.usable_length(matched.pages, matched.length)
        assert _readable(self.kv, handle, handle.cached_len)
        self.tokens[id(handle)] = tokens
        self.computed[id(handle)] = handle.cached_len
        self.live[id(handle)] = handle
        return handle

    @rule(handle=handles, n=st.integers(1, 5))
    def step(self, handle: CacheHandle, n: int) -> None:
        key = id(handle)
        if key not in self.live:
            return
        done = self.computed[key]
        self.kv.slide(handle, done)
        if self.kv.allocate(handle, done + n):
            self.computed[key] = done + n
            assert _readable(self.kv, handle, done)  # this step's queries read their window

    @rule(handle=handles)
    def cache(self, handle: CacheHandle) -> None:
        key = id(handle)
        if key not in self.live:
            return
        tokens = self.tokens[key]
        done = min(self.computed[key], len(tokens))
        self.kv.cache(handle, tokens[:done])

    @rule(handle=consumes(handles), keep=st.booleans())
    def release(self, handle: CacheHandle, keep: bool) -> None:
        key = id(handle)
        if key not in self.live:
            return
        del self.live[key]
        tokens = self.tokens.pop(key)
        done = min(self.computed.pop(key), len(tokens))
        self.kv.release(handle, tokens[:done] if keep else None)

    @invariant()
    def every_page_and_slot_in_one_place(self) -> None:
        self.kv.check(self.live.values())
        stats = self.kv.stats()
        assert stats.free + stats.cached + stats.private == stats.total
        assert 0 <= stats.window_free <= stats.window_slots

    @invariant()
    def every_running_window_is_readable(self) -> None:
        for key, handle in self.live.items():
            window = self.kv.window
            assert window is not None
            first = max(handle.window_from, 0)
            assert all(window.slot_of[p] >= 0 for p in handle.pages[first:]), key

    def teardown(self) -> None:
        for handle in list(self.live.values()):
            self.kv.release(handle)
        self.kv.check([])
        window = self.kv.window
        assert window is not None and not window.held.any()


TestWindowSlotsMachine = WindowSlotsMachine.TestCase
TestWindowSlotsMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
