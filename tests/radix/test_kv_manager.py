"""KVManager: every page in exactly one place, handles that follow the tree, and events that
tell a listener exactly which pages the tree holds (a hypothesis state machine)."""

from __future__ import annotations

import hypothesis.strategies as st
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

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(num_pages=12, page_size=PAGE)
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
        stats = self.kv.stats()
        assert stats.free + stats.cached == stats.total and stats.private == 0


TestKVManagerMachine = KVManagerMachine.TestCase
TestKVManagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
