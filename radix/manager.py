"""KVManager: the one owner of KV pages (the prefix tree and the free list) and their handles.

The scheduler decides which requests run; the manager decides where their KV lives. Each
running request holds one ``CacheHandle``: its page table, of which the first ``cached_len``
tokens' pages belong to the tree (kept from eviction by the handle's lock on ``node``) and the
rest are private to the request. Every page is, at every moment, in exactly one place: the
free list, the tree, or one handle's private tail (``check``).

Whoever needs to follow the tree without walking it (the scheduler's index of waiting
matches, the KV-event publisher a router follows) subscribes to the manager's ``PagesStored`` and
``PagesEvicted`` events: every insert and eviction goes through here. The KV tiers below the
pool (``radix.tiers``) are called directly instead: evicted pages must be copied down before
their ids are reused, and admitted requests load pages back (``load``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from radix.allocator import PageAllocator
from radix.cache import RadixCache
from radix.node import Node, PrefixMatch
from radix.pins import PinTable
from radix.tiers import EvictedPage, KVTiers, Tier, TierChanged, TierHit, TierStats
from radix.tokens import TOKEN_BYTES, encode_tokens
from radix.window import WindowSlots


@dataclass(eq=False, slots=True)
class CacheHandle:
    """A running request's KV: ``pages[i]`` holds tokens ``[i*p, (i+1)*p)``.

    The pages of the first ``cached_len`` tokens are the tree's: the path to ``node``, which
    this handle keeps locked. The pages after them are private to the request. With window
    slots (``WindowSlots``) the handle holds the slots of ``pages[window_from:]``: what its
    next queries read in a window layer. Only the manager changes a handle.
    """

    namespace: str | None
    node: Node
    pages: list[int]
    cached_len: int
    window_from: int = 0
    hit_end: int = 0  # pages of the prefix found cached: the window before it is a tail


@dataclass(frozen=True, slots=True)
class PagesStored:
    """The tree gained ``pages`` holding ``tokens`` (whole pages), right after
    ``parent_page`` (None: at the root of ``namespace``); ``hashes`` are their content
    addresses (``radix.page_hashes`` chain, namespace-seeded)."""

    namespace: str | None
    parent_page: int | None
    tokens: Sequence[int]
    pages: Sequence[int]
    hashes: Sequence[int]


@dataclass(frozen=True, slots=True)
class PagesEvicted:
    """The tree dropped ``pages`` (now free), whose content addresses were ``hashes``."""

    pages: Sequence[int]
    hashes: Sequence[int]


# TierChanged (radix.tiers): a tier below the pool gained or lost pages (listeners of the
# pool alone ignore it): with it a listener knows where every page is, not only the pool's.
KVEvent = PagesStored | PagesEvicted | TierChanged


@dataclass(frozen=True, slots=True)
class TierLoad:
    """Tokens a ``KVManager.load`` brought into the pool, by the tier they came from."""

    host: int = 0
    disk: int = 0
    remote: int = 0

    @property
    def total(self) -> int:
        return self.host + self.disk + self.remote


NO_LOAD = TierLoad()


@dataclass(frozen=True, slots=True)
class PageStats:
    """Where the pages are now: ``free + cached + private == total`` always; at idle
    ``private == 0``. ``evicted`` only grows."""

    total: int
    free: int
    cached: int
    evictable: int
    private: int
    evicted: int
    pinned: int = 0  # pages kept by pins (radix/pins.py), a part of ``cached``
    pins: int = 0
    pins_released: int = 0  # pins ended by their lifetime, the budget or a need for pages
    window_slots: int = 0  # window-layer page slots (0: every page holds every layer)
    window_free: int = 0
    window_reclaimed: int = 0  # slots taken from cached pages (only grows)


class KVManager:
    """Owns the ``RadixCache`` and the ``PageAllocator`` of one KV pool of ``num_pages``.

    ``prefix_cache=False`` keeps the tree empty: nothing computed is ever shared, and every
    page a request had goes back to the free list when it ends (the benchmarks' baseline).
    ``window``: the window layers' slots (``radix.window``) of a window-aware pool; a hit is
    then cut back to where the window before it still has its KV.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        prefix_cache: bool = True,
        tiers: KVTiers | None = None,
        max_pinned_fraction: float = 0.5,
        window: WindowSlots | None = None,
    ) -> None:
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(
                f"max_pinned_fraction: must be in [0, 1], got {max_pinned_fraction!r}"
            )
        if tiers is not None and not prefix_cache:
            raise ValueError("tiers: KV tiers need prefix_cache=True (nothing would be cached)")
        if window is not None and tiers is not None:
            raise ValueError("tiers: KV tiers do not keep window slots (use one or the other)")
        if window is not None and len(window.slot_of) != num_pages:
            raise ValueError(f"window: made for {len(window.slot_of)} pages, not {num_pages}")
        self._window = window
        self._tree = RadixCache(page_size)
        self._allocator = PageAllocator(num_pages)
        self._page_size = page_size
        self._prefix_cache = prefix_cache
        self._tiers = tiers
        self._listeners: list[Callable[[KVEvent], None]] = []
        # Listeners of evictions alone: the cache's stores are not described for them.
        self._eviction_listeners: list[Callable[[PagesEvicted], None]] = []
        self._evicted = 0
        self._pins = PinTable(self._tree, int(num_pages * max_pinned_fraction))

    # ------------------------------------------------------------------ state

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._allocator.num_pages

    @property
    def prefix_cache(self) -> bool:
        return self._prefix_cache

    @property
    def available(self) -> int:
        """Pages that can be had now: free, or cached and evictable."""
        return self._allocator.num_free + self._tree.evictable_pages

    @property
    def evicted_pages(self) -> int:
        """Pages evicted from the tree so far (only grows)."""
        return self._evicted

    @property
    def tree(self) -> RadixCache:
        """The prefix tree, for reading (benchmarks, tests); change it only through here."""
        return self._tree

    @property
    def allocator(self) -> PageAllocator:
        """The free list, for reading; change it only through here."""
        return self._allocator

    @property
    def tiers(self) -> KVTiers | None:
        """The host/disk tiers under the pool (None: an evicted page is gone)."""
        return self._tiers

    @property
    def pins(self) -> PinTable:
        """The pins: cached prefixes kept in the pool for a while (``pin``, ``drop``,
        ``expire``, ``release_oldest``: on the loop's thread, as everything here)."""
        return self._pins

    @property
    def window(self) -> WindowSlots | None:
        """The window layers' slots (None: the pool keeps every layer of every page)."""
        return self._window

    @property
    def growable(self) -> int:
        """Pages a request can add now: ``available``, and as many window slots."""
        if self._window is None:
            return self.available
        return min(self.available, self._window.available)

    def tier_stats(self) -> TierStats | None:
        return None if self._tiers is None else self._tiers.stats()

    def stats(self) -> PageStats:
        free = self._allocator.num_free
        cached = self._tree.cached_pages
        total = self._allocator.num_pages
        return PageStats(
            total=total,
            free=free,
            cached=cached,
            evictable=self._tree.evictable_pages,
            private=total - free - cached,
            evicted=self._evicted,
            pinned=self._pins.pinned_pages(),
            pins=len(self._pins.pins),
            pins_released=self._pins.released,
            **self._window_stats(),
        )

    def _window_stats(self) -> dict[str, int]:
        window = self._window
        if window is None:
            return {}
        return {
            "window_slots": window.num_slots,
            "window_free": window.num_free,
            "window_reclaimed": window.reclaimed,
        }

    def subscribe(self, listener: Callable[[KVEvent], None]) -> None:
        """Call ``listener`` with every PagesStored and PagesEvicted from now on, and with the
        tiers' TierChanged (first what they hold already) when there are tiers."""
        self._listeners.append(listener)
        if self._tiers is not None:
            self._tiers.subscribe(listener)

    def subscribe_evictions(self, listener: Callable[[PagesEvicted], None]) -> None:
        """Call ``listener`` with every PagesEvicted from now on, and nothing else: a listener
        that needs only evictions costs the cache's stores nothing."""
        self._eviction_listeners.append(listener)

    # ------------------------------------------------------------------ requests' KV

    def match(self, tokens: Sequence[int], namespace: str | None = None) -> PrefixMatch:
        """The longest cached page-aligned prefix of ``tokens`` (nothing is locked)."""
        return self._tree.match_prefix(tokens, namespace)

    def acquire(self, tokens: Sequence[int], namespace: str | None = None) -> CacheHandle:
        """A handle on the cached prefix of ``tokens``, locked so it stays until ``release``."""
        found = self._tree.match_prefix(tokens, namespace)
        window = self._window
        if window is None:
            self._tree.lock(found.node)
            return CacheHandle(namespace, found.node, list(found.pages), found.length)
        usable = window.usable_length(found.pages, found.length)
        if usable < found.length:
            found = self._tree.match_prefix(tokens[:usable], namespace)
        self._tree.lock(found.node)
        start = window.first_needed(found.length)
        window.hold(found.pages[start:])
        hit = len(found.pages)
        return CacheHandle(namespace, found.node, list(found.pages), found.length, start, hit)

    def slide(self, handle: CacheHandle, query_pos: int) -> None:
        """``handle``'s next queries start at ``query_pos``: the window slots of its pages no
        window layer reads from there on are no longer its to keep, but for a quarter window
        more (``WindowSlots.tail_start``), which becomes its tail when it ends."""
        window = self._window
        if window is None:
            return
        start = min(window.tail_start(query_pos), len(handle.pages))
        begin = handle.window_from
        if start > begin:
            for i in range(begin, start):  # the window before a hit or a checkpoint: a tail
                tail = i < handle.hit_end or window.before_checkpoint(i)
                window.drop((handle.pages[i],), tail=tail)
            handle.window_from = start

    def allocate(self, handle: CacheHandle, num_tokens: int, evict: bool = True) -> bool:
        """Grow ``handle``'s page table to hold ``num_tokens`` tokens, evicting LRU pages if
        the free list is short (unless not ``evict``: speculative tokens never push cached
        prefixes out). False (and nothing taken) when not enough can be had."""
        need = -(-num_tokens // self._page_size) - len(handle.pages)
        if need <= 0:
            return True
        window = self._window
        if window is not None and need > window.available:
            return False  # evicting pool pages frees no slot a hold keeps
        allocator = self._allocator
        short = need - allocator.num_free
        if short > 0:
            if not evict or short > self._tree.evictable_pages:
                return False
            if self._tiers is None and not self._listeners and not self._eviction_listeners:
                freed = self._tree.evict(short)
            else:
                described: list[EvictedPage] = []
                freed = self._tree.evict(short, described)
                if self._tiers is not None:
                    self._tiers.write_back(described)  # before any freed id is reused
                if self._listeners or self._eviction_listeners:
                    event = PagesEvicted(freed, [page.key for page in described])
                    self._announce(event)
                    for evictions in self._eviction_listeners:
                        evictions(event)
            if window is not None:
                window.forget(freed)
            allocator.free(freed)
            self._evicted += len(freed)
        pages = allocator.alloc(need)
        assert pages is not None, "eviction freed fewer pages than it promised"
        if window is not None:
            given = window.give(pages)
            assert given, "window slots ran short after they were counted"
        handle.pages.extend(pages)
        return True

    def continuation(
        self, handle: CacheHandle, tokens: Sequence[int], max_tokens: int
    ) -> list[int]:
        """Up to ``max_tokens`` tokens the tree holds after ``handle``'s cached prefix followed
        by ``tokens`` (a request's tokens after ``cached_len``): what an earlier request with
        the same sequence went on with, in the handle's namespace only. Changes nothing."""
        return self._tree.continuation(handle.node, tokens, max_tokens)

    def cache(self, handle: CacheHandle, tokens: Sequence[int]) -> CacheHandle:
        """Hand the whole pages of ``tokens`` (computed, in ``handle.pages``) to the tree.

        The handle's pages for tokens the tree already had are duplicates: they are freed and
        replaced by the tree's. The handle's lock moves down to the end of ``tokens``.
        Returns the handle (updated in place; no second walk of the tree).
        """
        p = self._page_size
        aligned = len(tokens) - len(tokens) % p
        if not self._prefix_cache or aligned <= handle.cached_len:
            return handle
        tree = self._tree
        namespace = handle.namespace
        num_pages = aligned // p
        inserted = tree.insert_prefix(tokens[:aligned], handle.pages[:num_pages], namespace)
        found = inserted.match
        tree.lock(found.node)
        tree.unlock(handle.node)
        first_dup = handle.cached_len // p
        duplicates = handle.pages[first_dup : inserted.cached // p]
        if duplicates:
            if self._window is not None:
                self._swap_window(handle, first_dup, found.pages[first_dup : inserted.cached // p])
                self._window.forget(duplicates)
            self._allocator.free(duplicates)
        handle.pages[:num_pages] = found.pages
        handle.node = found.node
        handle.cached_len = aligned
        if inserted.cached < aligned and self._tiers is not None and self._tiers.remote is not None:
            first = inserted.cached // p
            keys = _last_hashes(found.node, num_pages - first)
            buf = encode_tokens(tokens[inserted.cached : aligned])
            step = p * TOKEN_BYTES
            self._tiers.share([
                EvictedPage(page, key, buf[i * step : (i + 1) * step])
                for i, (page, key) in enumerate(zip(found.pages[first:], keys))
            ])
        if inserted.cached < aligned and self._listeners:
            first = inserted.cached // p
            self._announce(
                PagesStored(
                    namespace,
                    found.pages[first - 1] if first else None,
                    tokens[inserted.cached : aligned],
                    found.pages[first:],
                    _last_hashes(found.node, num_pages - first),
                )
            )
        return handle

    def _swap_window(self, handle: CacheHandle, first: int, keepers: Sequence[int]) -> None:
        """The tree's ``keepers`` replace ``handle``'s pages from index ``first`` on: the
        handle's holds move to them, with the slots of the window KV it just computed where
        the tree's pages had lost theirs."""
        window = self._window
        assert window is not None
        for i, keeper in enumerate(keepers, start=first):
            duplicate = handle.pages[i]
            held = i >= handle.window_from
            if held:
                window.drop([duplicate])
            window.adopt(keeper, duplicate)
            if held:
                window.hold([keeper])

    def load(self, handle: CacheHandle, tokens: Sequence[int]) -> TierLoad:
        """Extend a fresh handle's cached prefix with the pages of ``tokens`` found below the
        pool: fresh pool pages (evicting if need be), the KV copied in, the pages into the
        tree and the handle's lock moved down. Call it before the request computes anything
        (the handle holds no private pages yet)."""
        tiers, p = self._tiers, self._page_size
        if tiers is None or len(handle.pages) * p != handle.cached_len:
            return NO_LOAD
        start = handle.cached_len
        hits = self._below(tokens, start, handle.node.hash)
        if not hits:
            return NO_LOAD
        fetched = tiers.fetch(hits)
        end = start + len(fetched) * p
        if not fetched or not self.allocate(handle, end):
            return NO_LOAD
        tiers.install(handle.pages[start // p :], fetched)
        self.cache(handle, tokens[:end])
        host = p * sum(1 for page in fetched if page.tier is Tier.HOST)
        remote = p * sum(1 for page in fetched if page.tier is Tier.REMOTE)
        return TierLoad(host=host, disk=end - start - host - remote, remote=remote)

    def _below(self, tokens: Sequence[int], start: int, seed: int) -> list[TierHit]:
        """The whole pages of ``tokens`` after the first ``start`` found below the pool, in
        order; ``seed`` is the content address of the prefix they continue (the handle's
        node's hash), so the chain goes on from the tree without hashing the prefix again."""
        assert self._tiers is not None
        p = self._page_size
        end = len(tokens) - len(tokens) % p
        if start >= end:
            return []
        return self._tiers.lookup(seed, encode_tokens(tokens[start:end]), p * TOKEN_BYTES)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """A forward pass computed ``tokens`` tokens in ``seconds`` (what a load must beat)."""
        if self._tiers is not None:
            self._tiers.observe_compute(tokens, seconds)

    def close(self) -> None:
        """Write what the pool and host memory hold to the disk tier (a restarted engine
        finds it there) and stop its writer. Call when nothing runs any more."""
        if self._tiers is None:
            return
        self._tiers.persist(self._tree.walk_pages())
        self._tiers.close()

    def release(self, handle: CacheHandle, tokens: Sequence[int] | None = None) -> None:
        """End ``handle``: cache the whole pages of ``tokens`` first (when given), free the
        private pages, drop the lock. The handle must not be used afterwards."""
        if tokens is not None:
            self.cache(handle, tokens)
        private = handle.pages[handle.cached_len // self._page_size :]
        window = self._window
        if window is not None:
            window.drop(handle.pages[handle.window_from :], tail=True)  # held: its tail
            window.forget(private)
            handle.window_from = 0
        if private:
            self._allocator.free(private)
        self._tree.unlock(handle.node)
        handle.pages = []
        handle.cached_len = 0

    # ------------------------------------------------------------------ integrity

    def check(self, handles: Iterable[CacheHandle]) -> None:
        """Raise AssertionError unless every page is in exactly one place: free, the tree, or
        one of ``handles``' private tails (all live handles must be given), and each handle's
        tree part is exactly the path to its locked node."""
        tree, allocator, p = self._tree, self._allocator, self._page_size
        tree.check_invariants()
        tree_pages = _tree_pages(tree)
        for page in tree_pages:
            assert not allocator.is_free(page), f"page {page} is both free and in the tree"
        private: set[int] = set()
        holds: dict[int, int] = {}
        live = 0
        for handle in handles:
            live += 1
            for page in handle.pages[handle.window_from :]:
                holds[page] = holds.get(page, 0) + 1
            assert handle.cached_len % p == 0, "handle: cached_len is not page-aligned"
            assert handle.node.own_locks > 0, "handle: holds no lock on its node"
            assert _path_pages(handle.node) == handle.pages[: handle.cached_len // p], (
                "handle: its page table's tree part differs from its node's path"
            )
            for page in handle.pages[handle.cached_len // p :]:
                assert page not in private, f"page {page} is private to two handles"
                assert page not in tree_pages, f"page {page} is private and in the tree"
                assert not allocator.is_free(page), f"page {page} is private and free"
                private.add(page)
        total = allocator.num_free + len(tree_pages) + len(private)
        assert total == allocator.num_pages, (
            f"free {allocator.num_free} + tree {len(tree_pages)} + private {len(private)} "
            f"!= {allocator.num_pages} pages"
        )
        if not live:
            pinned = self._pins.pinned_pages()
            assert tree.protected_pages == pinned, (
                f"idle with {tree.protected_pages} locked pages, {pinned} of them pinned"
            )
        assert self._pins.pinned_pages() <= self._pins.max_pages, "pins over their budget"
        for pin in self._pins.pins.values():
            assert pin.active and pin.node.own_locks > 0, "pin: holds no lock on its node"
        if self._tiers is not None:
            self._tiers.check()
        if self._window is not None:
            self._window.check(list(tree_pages | private), holds)

    def _announce(self, event: KVEvent) -> None:
        for listener in self._listeners:
            listener(event)


def _tree_pages(tree: RadixCache) -> set[int]:
    pages: set[int] = set()
    for namespace in tree.namespaces:
        stack = [tree.root(namespace)]
        while stack:
            node = stack.pop()
            for page in node.pages:
                assert page not in pages, f"page {page} appears twice in the tree"
                pages.add(page)
            stack.extend(node.children.values())
    return pages


def _last_hashes(node: Node, count: int) -> list[int]:
    """The content addresses of the last ``count`` pages on the path to ``node``."""
    chunks: list[list[int]] = []
    while count > 0 and node.parent is not None:
        hashes = node.page_hashes
        chunks.append(hashes[-count:])
        count -= len(hashes)
        node = node.parent
    return [h for chunk in reversed(chunks) for h in chunk]


def _path_pages(node: Node | None) -> list[int]:
    chunks = []
    while node is not None:
        chunks.append(node.pages)
        node = node.parent
    return [page for chunk in reversed(chunks) for page in chunk]
