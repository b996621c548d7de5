"""KVManager: every page in exactly one place, handles that follow the tree, and events that
tell a listener exactly which pages the tree holds (a hypothesis state machine, pins with
lifetimes and a budget among its rules)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from radix import CacheHandle, KVEvent, KVManager, PagesEvicted, PagesStored

PAGE = 2
STEMS = [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8], [9, 9, 9, 9, 9, 9, 9, 9]]


def test_cache_moves_the_lock_down_and_frees_duplicate_pages() -> None:
    kv = KVManager(num_pages=8, page_size=2)
    first = kv.acquire([1, 2, 3, 4])
    assert first.cached_len == 0 and first.pages == []
    assert kv.allocate(first, 5)
    assert len(first.pages) == 3
    kv.cache(first, [1, 2, 3, 4, 5])
    assert first.cached_len == 4 and kv.stats().cached == 2
    second = kv.acquire([1, 2, 3, 4])
    assert second.cached_len == 4 and second.pages == first.pages[:2]
    kv.release(first, [1, 2, 3, 4, 5])
    kv.release(second)
    stats = kv.stats()
    assert stats.free + stats.cached == stats.total and stats.private == 0
    kv.check([])


def test_a_request_that_computed_a_cached_prefix_again_gives_its_copies_back() -> None:
    kv = KVManager(num_pages=8, page_size=2)
    a, b = kv.acquire([1, 2, 3, 4]), kv.acquire([1, 2, 3, 4])
    assert kv.allocate(a, 4) and kv.allocate(b, 4)
    kv.cache(a, [1, 2, 3, 4])
    copies = b.pages[:]
    kv.cache(b, [1, 2, 3, 4])
    assert b.pages == a.pages and all(kv.allocator.is_free(p) for p in copies)
    kv.check([a, b])


def test_without_prefix_cache_nothing_enters_the_tree() -> None:
    kv = KVManager(num_pages=4, page_size=2, prefix_cache=False)
    handle = kv.acquire([1, 2, 3])
    assert kv.allocate(handle, 3)
    kv.release(handle, [1, 2, 3])
    assert kv.stats().cached == 0 and kv.stats().free == 4


def test_an_eviction_listener_hears_the_evictions_and_nothing_else() -> None:
    events: list[KVEvent] = []
    evictions: list[PagesEvicted] = []
    kv = KVManager(num_pages=2, page_size=2)
    kv.subscribe(events.append)
    kv.subscribe_evictions(evictions.append)
    old = kv.acquire([1, 2, 3, 4])
    assert kv.allocate(old, 4)
    kv.release(old, [1, 2, 3, 4])
    new = kv.acquire([5, 6])
    assert kv.allocate(new, 2)
    assert evictions and evictions == [e for e in events if isinstance(e, PagesEvicted)]
    kv.release(new)


def test_allocate_evicts_unlocked_pages_and_says_so() -> None:
    events: list[KVEvent] = []
    kv = KVManager(num_pages=2, page_size=2)
    kv.subscribe(events.append)
    old = kv.acquire([1, 2, 3, 4])
    assert kv.allocate(old, 4)
    kv.release(old, [1, 2, 3, 4])
    new = kv.acquire([5, 6])
    assert kv.allocate(new, 2)
    assert isinstance(events[0], PagesStored) and isinstance(events[-1], PagesEvicted)
    assert kv.stats().evicted == 1
    assert not kv.allocate(new, 8)  # more than the pool: nothing taken
    assert len(new.pages) == 1
    kv.release(new)


class KVManagerMachine(RuleBasedStateMachine):
    handles = Bundle("handles")
    pins = Bundle("pins")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(num_pages=12, page_size=PAGE, max_pinned_fraction=0.5)
        self.now = 0.0
        self.tokens: dict[int, list[int]] = {}  # id(handle) -> the request's tokens
        self.live: dict[int, CacheHandle] = {}
        self.tree_pages: set[int] = set()  # what the events say the tree holds
        self.tree_hashes: set[int] = set()  # and under which content addresses
        self.kv.subscribe(self._on_event)

    def _on_event(self, event: KVEvent) -> None:
        if isinstance(event, PagesStored):
            assert len(event.tokens) == PAGE * len(event.pages)
            assert not self.tree_pages & set(event.pages)
            assert len(event.hashes) == len(event.pages)
            assert not self.tree_hashes & set(event.hashes)
            self.tree_pages.update(event.pages)
            self.tree_hashes.update(event.hashes)
        else:
            assert set(event.pages) <= self.tree_pages
            assert set(event.hashes) <= self.tree_hashes
            assert len(event.hashes) == len(event.pages)
            self.tree_pages.difference_update(event.pages)
            self.tree_hashes.difference_update(event.hashes)

    @rule(
        target=handles,
        stem=st.integers(0, len(STEMS) - 1),
        cut=st.integers(0, 8),
        tail=st.lists(st.integers(1, 4), max_size=4),
        namespace=st.sampled_from([None, "b"]),
    )
    def acquire(self, stem: int, cut: int, tail: list[int], namespace: str | None) -> CacheHandle:
        tokens = STEMS[stem][:cut] + tail or [1]
        handle = self.kv.acquire(tokens, namespace)
        assert handle.cached_len % PAGE == 0 and handle.cached_len <= len(tokens)
        self.tokens[id(handle)] = tokens
        self.live[id(handle)] = handle
        return handle

    @rule(handle=handles, extra=st.integers(0, 3))
    def allocate(self, handle: CacheHandle, extra: int) -> None:
        if id(handle) not in self.live:
            return
        before = list(handle.pages)
        want = handle.cached_len + extra * PAGE
        if self.kv.allocate(handle, want):
            assert len(handle.pages) * PAGE >= want
        else:
            assert handle.pages == before

    @rule(handle=handles)
    def cache(self, handle: CacheHandle) -> None:
        if id(handle) not in self.live:
            return
        tokens = self.tokens[id(handle)]
        computed = tokens[: len(handle.pages) * PAGE]
        self.kv.cache(handle, computed)
        aligned = len(computed) - len(computed) % PAGE
        assert handle.cached_len == max(aligned, handle.cached_len)
        found = self.kv.match(computed[: handle.cached_len], handle.namespace)
        assert found.pages == handle.pages[: handle.cached_len // PAGE]

    @rule(handle=consumes(handles), keep=st.booleans())
    def release(self, handle: CacheHandle, keep: bool) -> None:
        if id(handle) not in self.live:
            return
        del self.live[id(handle)]
        tokens = self.tokens.pop(id(handle))
        self.kv.release(handle, tokens[: len(handle.pages) * PAGE] if keep else None)

    @rule(target=pins, stem=st.integers(0, len(STEMS) - 1), cut=st.integers(0, 8),
          namespace=st.sampled_from([None, "b"]), ttl=st.sampled_from([1.0, 5.0]))
    def pin(self, stem: int, cut: int, namespace: str | None, ttl: float) -> object:
        tokens = STEMS[stem][:cut] or [1]
        cached = self.kv.match(tokens, namespace)
        found = self.kv.pins.pin(tokens, namespace, ttl, self.now)
        if cached.length == 0:
            assert found is None
        else:
            assert found is not None and found.length == cached.length
        return found

    @rule(pin=consumes(pins))
    def unpin(self, pin: object) -> None:
        if pin is not None:
            self.kv.pins.drop(pin)  # type: ignore[arg-type]
            assert not pin.active  # type: ignore[attr-defined]

    @rule(seconds=st.sampled_from([0.5, 2.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.kv.pins.expire(self.now)

    @invariant()
    def pins_keep_their_pages_within_the_budget(self) -> None:
        stats = self.kv.stats()
        assert stats.pinned <= 6  # half the pool
        assert stats.pinned <= stats.cached

    @invariant()
    def every_page_in_one_place(self) -> None:
        self.kv.check(self.live.values())
        stats = self.kv.stats()
        assert stats.free + stats.cached + stats.private == stats.total

    @invariant()
    def events_tell_exactly_what_the_tree_holds(self) -> None:
        assert self.kv.stats().cached == len(self.tree_pages)
        assert {page.key for page in self.kv.tree.walk_pages()} == self.tree_hashes

    def teardown(self) -> None:
        for handle in list(self.live.values()):
            self.kv.release(handle)
        self.kv.check([])
        self.kv.pins.expire(self.now + 10.0)
        assert self.kv.stats().pinned == 0 and self.kv.tree.protected_pages == 0
        stats = self.kv.stats()
        assert stats.free + stats.cached == stats.total and stats.private == 0


TestKVManagerMachine = KVManagerMachine.TestCase
TestKVManagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def _cached(kv: KVManager, tokens: list[int], namespace: str | None = None) -> None:
    """Puts ``tokens`` (whole pages) in the tree as a finished request would."""
    handle = kv.acquire(tokens, namespace)
    assert kv.allocate(handle, len(tokens))
    kv.release(handle, tokens)


def test_a_pinned_prefix_survives_the_pressure_that_evicts_everything_else() -> None:
    kv = KVManager(num_pages=8, page_size=2, max_pinned_fraction=0.5)
    kept, other = [1, 2, 3, 4], [5, 6, 7, 8]
    _cached(kv, kept)
    _cached(kv, other)
    pin = kv.pins.pin(kept, None, ttl=60.0, now=0.0)
    assert pin is not None and kv.stats().pinned == 2
    flood = kv.acquire([9] * 12)
    assert kv.allocate(flood, 12)  # takes every page it can: the unpinned ones go
    assert kv.match(kept).length == 4 and kv.match(other).length == 0
    assert not kv.allocate(flood, 14)  # the pinned pages are not for taking
    kv.release(flood)
    kv.check([])


def test_a_pin_ends_with_its_lifetime_and_its_pages_become_evictable() -> None:
    kv = KVManager(num_pages=8, page_size=2)
    _cached(kv, [1, 2, 3, 4])
    kv.pins.pin([1, 2, 3, 4], None, ttl=5.0, now=100.0)
    assert kv.pins.expire(104.9) == [] and kv.stats().evictable == 0
    assert len(kv.pins.expire(105.0)) == 1
    assert kv.stats().pinned == 0 and kv.stats().evictable == 2 and kv.pins.released == 1


def test_past_the_budget_the_oldest_pins_are_released() -> None:
    kv = KVManager(num_pages=8, page_size=2, max_pinned_fraction=0.5)  # 4 pages
    for base in (10, 20, 30):
        _cached(kv, [base, base + 1, base + 2, base + 3])
    first = kv.pins.pin([10, 11, 12, 13], None, 60.0, 0.0)
    second = kv.pins.pin([20, 21, 22, 23], None, 60.0, 1.0)
    third = kv.pins.pin([30, 31, 32, 33], None, 60.0, 2.0)
    assert first is not None and second is not None and third is not None
    assert not first.active and second.active and third.active
    assert kv.stats().pinned == 4 and kv.stats().pins == 2
    kv.check([])


def test_past_the_budget_a_tenants_flood_of_pins_ends_its_own_first() -> None:
    kv = KVManager(num_pages=16, page_size=2, max_pinned_fraction=0.5)  # 8 pages
    _cached(kv, [1, 2, 3, 4], namespace="quiet")
    quiet = kv.pins.pin([1, 2, 3, 4], "quiet", 60.0, 0.0)  # the oldest pin, 2 pages
    flood = []
    for base in range(10, 70, 10):  # six pins of 2 pages each by another tenant
        tokens = [base, base + 1, base + 2, base + 3]
        _cached(kv, tokens, namespace="flood")
        flood.append(kv.pins.pin(tokens, "flood", 60.0, 1.0))
    assert quiet is not None and quiet.active  # the flood's oldest gave way, not the quiet one
    assert [pin.active for pin in flood] == [False, False, False, True, True, True]
    assert kv.stats().pinned == 8
    assert kv.pins.release_oldest() and quiet.active and not flood[3].active
    kv.check([])


def test_a_shared_prefix_under_two_pins_counts_once() -> None:
    kv = KVManager(num_pages=8, page_size=2)
    _cached(kv, [1, 2, 3, 4, 5, 6])
    _cached(kv, [1, 2, 3, 4, 7, 8])
    kv.pins.pin([1, 2, 3, 4, 5, 6], None, 60.0, 0.0)
    kv.pins.pin([1, 2, 3, 4, 7, 8], None, 60.0, 0.0)
    assert kv.stats().pinned == 4  # the two shared pages once, plus one of each


def test_pins_are_per_namespace_and_need_something_cached() -> None:
    kv = KVManager(num_pages=8, page_size=2)
    _cached(kv, [1, 2, 3, 4], namespace="a")
    assert kv.pins.pin([1, 2, 3, 4], "b", 60.0, 0.0) is None
    assert kv.pins.pin([1, 2, 3, 4], "a", 60.0, 0.0) is not None
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="ttl"):
            kv.pins.pin([1, 2, 3, 4], "a", bad, 0.0)
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        KVManager(num_pages=8, page_size=2, max_pinned_fraction=1.5)


def test_dropping_a_finished_requests_pin_leaves_the_shorter_pins_on_its_path() -> None:
    kv = KVManager(num_pages=16, page_size=2)
    first = [1, 2, 3, 4, 5]  # a turn: its pin holds the pages of all but its last token
    second = first + [6, 7, 8, 9]
    _cached(kv, second[:8], namespace="t")
    earlier = kv.pins.pin(first, "t", 60.0, 0.0)
    later = kv.pins.pin(second, "t", 60.0, 0.0)
    assert earlier is not None and later is not None and (earlier.length, later.length) == (4, 8)
    assert kv.pins.drop_prefix(second, "other") == 0  # another tenant's tokens end nothing
    assert kv.pins.drop_prefix(second, "t") == 1
    assert earlier.active and not later.active
    assert kv.pins.drop_prefix(first, "t") == 1 and not earlier.active
    kv.check([])
