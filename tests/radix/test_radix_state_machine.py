"""RadixCache + PageAllocator against a naive reference model, driven by hypothesis.

The model is a dict from (namespace, page-aligned prefix) to the page holding that prefix's
last page, with a per-page last-access time. It predicts match results, insert's return value
and exactly which pages a per-page LRU evicts (the oldest unlocked page with no cached
extension), which the tree must reproduce.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from radix import Node, PageAllocator, RadixCache, page_hashes

NAMESPACES = st.sampled_from([None, "tenant"])
NUM_PAGES = 24

Prefix = tuple[str | None, tuple[int, ...]]


class ReferenceModel:
    """Per-page LRU over page-aligned prefixes, written for clarity, not speed."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[Prefix, int] = {}
        self.time: dict[Prefix, tuple[int, int]] = {}
        self.locks: list[Prefix] = []
        self.op = 0

    def prefixes(self, namespace: str | None, tokens: tuple[int, ...]) -> list[Prefix]:
        p = self.page_size
        return [(namespace, tokens[: p * i]) for i in range(1, len(tokens) // p + 1)]

    def cached(self, namespace: str | None, tokens: tuple[int, ...]) -> list[Prefix]:
        out = []
        for prefix in self.prefixes(namespace, tokens):
            if prefix not in self.pages:
                break
            out.append(prefix)
        return out

    def touch(self, prefixes: list[Prefix]) -> None:
        self.op += 1
        for depth, prefix in enumerate(prefixes):
            self.time[prefix] = (self.op, depth)

    def is_locked(self, prefix: Prefix) -> bool:
        ns, toks = prefix
        return any(
            ns == lns and ltoks[: len(toks)] == toks and len(ltoks) >= len(toks)
            for lns, ltoks in self.locks
        )

    def has_extension(self, prefix: Prefix) -> bool:
        ns, toks = prefix
        n = len(toks) + self.page_size
        return any(k[0] == ns and len(k[1]) == n and k[1][: len(toks)] == toks for k in self.pages)

    def evict(self, num_pages: int) -> list[int]:
        freed = []
        for _ in range(num_pages):
            candidates = [
                k for k in self.pages if not self.has_extension(k) and not self.is_locked(k)
            ]
            if not candidates:
                break
            oldest = min(candidates, key=self.time.__getitem__)
            freed.append(self.pages.pop(oldest))
            del self.time[oldest]
        return freed


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    vocab = 2

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(self.page_size)
        self.allocator = PageAllocator(NUM_PAGES)
        self.model = ReferenceModel(self.page_size)

    locks = Bundle("locks")

    def tokens(self) -> st.SearchStrategy[list[int]]:
        return st.lists(st.integers(0, self.vocab - 1), max_size=4 * self.page_size + 2)

    def _to_input(self, tokens: list[int], as_numpy: bool) -> list[int] | np.ndarray:
        return np.array(tokens, dtype=np.int64) if as_numpy else tokens

    def _evict(self, num_pages: int) -> None:
        expected = self.model.evict(num_pages)
        freed = self.cache.evict(num_pages)
        assert sorted(freed) == sorted(expected), (freed, expected)
        self.allocator.free(freed)

    def _alloc(self, n: int) -> list[int] | None:
        short = n - self.allocator.num_free
        if short > 0:
            self._evict(short)
        return self.allocator.alloc(n)

    @rule(data=st.data(), namespace=NAMESPACES, as_numpy=st.booleans())
    def match(self, data: st.DataObject, namespace: str | None, as_numpy: bool) -> None:
        tokens = data.draw(self.tokens())
        cached = self.model.cached(namespace, tuple(tokens))
        result = self.cache.match_prefix(self._to_input(tokens, as_numpy), namespace)
        assert result.length == len(cached) * self.page_size
        assert result.pages == [self.model.pages[k] for k in cached]
        self.model.touch(cached)
        self._check_node_ends_at(result.node, namespace, tokens[: result.length])

    def _check_node_ends_at(self, node: Node, namespace: str | None, tokens: list[int]) -> None:
        keys = []
        while not node.is_root:
            keys.append(node.key)
            assert node.parent is not None
            node = node.parent
        assert node is self.cache.root(namespace)
        got = b"".join(reversed(keys))
        assert got == np.array(tokens, dtype="<i4").tobytes()

    @rule(data=st.data(), namespace=NAMESPACES, as_numpy=st.booleans())
    def insert_fresh_pages(
        self, data: st.DataObject, namespace: str | None, as_numpy: bool
    ) -> None:
        """Insert with a page for every whole page; the caller frees what was cached."""
        tokens = data.draw(self.tokens())
        n = len(tokens) // self.page_size
        pages = self._alloc(n)
        if pages is None:
            return
        cached = self.model.cached(namespace, tuple(tokens))
        got = self.cache.insert(self._to_input(tokens, as_numpy), pages, namespace)
        assert got == len(cached) * self.page_size
        duplicates = len(cached)
        self.allocator.free(pages[:duplicates])
        prefixes = self.model.prefixes(namespace, tuple(tokens))
        for prefix, page in zip(prefixes[duplicates:], pages[duplicates:]):
            self.model.pages[prefix] = page
        self.model.touch(prefixes)

    @rule(data=st.data(), namespace=NAMESPACES)
    def serve_request(self, data: st.DataObject, namespace: str | None) -> None:
        """The scheduler's flow: match, lock, allocate the miss, insert, free dups, unlock."""
        tokens = data.draw(self.tokens())
        match = self.cache.match_prefix(tokens, namespace)
        self.model.touch(self.model.cached(namespace, tuple(tokens)))
        self.cache.lock(match.node)
        self.model.locks.append((namespace, tuple(tokens[: match.length])))
        miss = len(tokens) // self.page_size - len(match.pages)
        new_pages = self._alloc(miss)
        if new_pages is not None:
            own = match.length // self.page_size
            cached = self.model.cached(namespace, tuple(tokens))
            got = self.cache.insert(tokens, match.pages + new_pages, namespace)
            assert got == len(cached) * self.page_size
            self.allocator.free(new_pages[: len(cached) - own])
            prefixes = self.model.prefixes(namespace, tuple(tokens))
            for prefix, page in zip(prefixes[len(cached) :], new_pages[len(cached) - own :]):
                self.model.pages[prefix] = page
            self.model.touch(prefixes)
        self.cache.unlock(match.node)
        self.model.locks.remove((namespace, tuple(tokens[: match.length])))

    @rule(target=locks, data=st.data(), namespace=NAMESPACES)
    def lock(self, data: st.DataObject, namespace: str | None) -> tuple[Node, Prefix]:
        tokens = data.draw(self.tokens())
        match = self.cache.match_prefix(tokens, namespace)
        self.model.touch(self.model.cached(namespace, tuple(tokens)))
        self.cache.lock(match.node)
        held = (namespace, tuple(tokens[: match.length]))
        self.model.locks.append(held)
        return match.node, held

    @rule(handle=consumes(locks))
    def unlock(self, handle: tuple[Node, Prefix]) -> None:
        node, held = handle
        self.cache.unlock(node)
        self.model.locks.remove(held)

    @precondition(lambda self: not self.model.locks)
    @rule(data=st.data())
    def unlock_without_lock_raises(self, data: st.DataObject) -> None:
        tokens = data.draw(self.tokens())
        node = self.cache.match_prefix(tokens).node
        self.model.touch(self.model.cached(None, tuple(tokens)))
        with pytest.raises(ValueError, match="not locked"):
            self.cache.unlock(node)

    @rule(num_pages=st.integers(0, NUM_PAGES + 2))
    def evict(self, num_pages: int) -> None:
        self._evict(num_pages)

    @rule(data=st.data(), namespace=NAMESPACES)
    def page_hashes_match_the_tree(self, data: st.DataObject, namespace: str | None) -> None:
        tokens = data.draw(self.tokens())
        match = self.cache.match_prefix(tokens, namespace)
        self.model.touch(self.model.cached(namespace, tuple(tokens)))
        expected = page_hashes(tokens[: match.length], self.page_size, namespace)
        node = match.node
        chain: list[int] = []
        while not node.is_root:
            chain[:0] = node.page_hashes
            assert node.parent is not None
            node = node.parent
        assert chain == expected

    @invariant()
    def tree_is_consistent_and_every_page_is_accounted_for(self) -> None:
        self.cache.check_invariants()
        cache, model = self.cache, self.model
        assert cache.cached_pages == len(model.pages)
        protected = sum(1 for k in model.pages if model.is_locked(k))
        assert cache.protected_pages == protected
        assert cache.evictable_pages == len(model.pages) - protected
        assert self.allocator.num_free + cache.cached_pages == self.allocator.num_pages


class PageSize1(RadixMachine):
    page_size = 1
    vocab = 2


class PageSize4(RadixMachine):
    page_size = 4
    vocab = 2


_SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestRadixPageSize1 = _SETTINGS(PageSize1).TestCase
TestRadixPageSize4 = _SETTINGS(PageSize4).TestCase
