"""Window slots: where the KV of a model's sliding-window layers lives, page by page.

A sliding-window layer never reads a key more than ``window`` positions behind its query, so
its KV is needed only near the end of each sequence. A window-aware pool keeps two page
spaces: the pool pages (every layer with full attention, and the page ids the tree and the
requests use) and a smaller space of window slots (the window layers). A pool page holds a
window slot (``slot_of[page] >= 0``) while it may still be read by a window layer.

Who needs a page's slot: each running request holds (``hold``) the pages of its current
window and a quarter window before it; the tree keeps the slots of cached pages until slots run short, then gives them up
least recently released first, in two classes: first the pages a request slid past (inside a
sequence), then the "tails", the window before a point a prefix is likely to be hit again: the
end of what a request cached (what it held when it ended), a prefix that was hit, and every
``checkpoint`` (four windows)
tokens, so that a fork nobody saw coming (a shared document followed by different questions)
is cut back at most that far. A cached prefix is usable only where
the window before its end still has slots: ``usable_length`` cuts a hit back to the longest
such prefix (the cache never serves a prefix whose window-layer KV is gone; it recomputes
from there).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from radix.allocator import PageAllocator

CHECKPOINT_WINDOWS = 4  # a tail window every this many windows of a sequence


class WindowSlots:
    """The window slots of ``num_pages`` pool pages: ``num_slots`` of them, ``window`` tokens
    (the widest window of the model's layers) at ``page_size`` tokens a page.

    ``slot_of`` is shared with the KV pool, which reads a window layer's pages through it.
    A slot is free, or owned by one page; a page's slot is held (``held[page] > 0``) or waits
    in the reclaim order. Only the KVManager changes it.
    """

    def __init__(self, num_pages: int, num_slots: int, window: int, page_size: int) -> None:
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        least = self.least_slots(window, page_size)
        if num_slots < least:
            raise ValueError(
                f"window_pages: {num_slots} window slots cannot hold one request's window of "
                f"{window} tokens and a page to grow (need >= {least} at page_size {page_size})"
            )
        self.window = window
        self.page_size = page_size
        self.checkpoint = -(-CHECKPOINT_WINDOWS * window // page_size) * page_size
        self.slot_of = np.full(num_pages, -1, dtype=np.int64)
        self.held = np.zeros(num_pages, dtype=np.int32)
        self._slots = PageAllocator(num_slots)
        # Pages with an unheld slot, oldest first: inside sequences, and tails (kept longer).
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._tails: OrderedDict[int, None] = OrderedDict()
        self.reclaimed = 0  # slots taken from cached pages (only grows)

    @staticmethod
    def least_slots(window: int, page_size: int) -> int:
        """The fewest slots that let one request move: the pages it holds and one more."""
        return -(-(window + window // 4) // page_size) + 2

    # ------------------------------------------------------------------ counts

    @property
    def num_slots(self) -> int:
        return self._slots.num_pages

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def available(self) -> int:
        """Slots that can be had now: free, or owned by a page nobody holds."""
        return self._slots.num_free + len(self._idle) + len(self._tails)

    def before_checkpoint(self, page: int) -> bool:
        """Whether ``page`` (an index in a sequence) is in the window before a checkpoint."""
        end = (page + 1) * self.page_size
        checkpoint = -(-end // self.checkpoint) * self.checkpoint
        return page >= self.first_needed(checkpoint)

    def tail_start(self, end: int) -> int:
        """The first page a running request at ``end`` holds, its tail when it ends: what
        queries from a quarter window before ``end`` read (a hit a little before the end: a
        document followed by a question and its answer)."""
        return self.first_needed(max(0, end - self.window // 4))

    def first_needed(self, query_pos: int) -> int:
        """The first page a query at ``query_pos`` (or later) reads in a window layer."""
        return max(0, query_pos - self.window + 1) // self.page_size

    # ------------------------------------------------------------------ holding

    def hold(self, pages: Sequence[int]) -> None:
        """Keep these pages' slots (each must have one)."""
        for page in pages:
            assert self.slot_of[page] >= 0, f"page {page} is held without a window slot"
            if self.held[page] == 0:
                self._idle.pop(page, None)
                self._tails.pop(page, None)
            self.held[page] += 1

    def drop(self, pages: Sequence[int], tail: bool = False) -> None:
        """Stop holding these pages' slots; a slot nobody holds waits to be reclaimed, after
        the others when ``tail`` (the window before a likely hit)."""
        idle = self._tails if tail else self._idle
        for page in pages:
            assert self.held[page] > 0, f"page {page}: window slot dropped more than held"
            self.held[page] -= 1
            if self.held[page] == 0:
                idle[page] = None

    def give(self, pages: Sequence[int]) -> bool:
        """A slot for each of ``pages`` (fresh pool pages, none has one), held; reclaiming
        the oldest unheld slots when the free ones are short. False (nothing changed) when
        there are not enough."""
        short = len(pages) - self._slots.num_free
        if short > len(self._idle) + len(self._tails):
            return False
        if short > 0:
            taken = []
            for _ in range(short):
                idle = self._idle if self._idle else self._tails
                page, _ = idle.popitem(last=False)
                taken.append(int(self.slot_of[page]))
                self.slot_of[page] = -1
            self._slots.free(taken)
            self.reclaimed += short
        slots = self._slots.alloc(len(pages))
        assert slots is not None
        for page, slot in zip(pages, slots):
            assert self.slot_of[page] < 0, f"page {page} has a window slot already"
            self.slot_of[page] = slot
            self.held[page] = 1
        return True

    def forget(self, pages: Sequence[int]) -> None:
        """These pool pages are free again: their slots too (none may be held)."""
        freed = []
        for page in pages:
            assert self.held[page] == 0, f"page {page} freed while its window slot is held"
            slot = int(self.slot_of[page])
            if slot >= 0:
                freed.append(slot)
                self.slot_of[page] = -1
                self._idle.pop(page, None)
                self._tails.pop(page, None)
        self._slots.free(freed)

    def adopt(self, keeper: int, duplicate: int) -> None:
        """``duplicate`` (about to be freed) holds the same tokens' KV as the tree's ``keeper``:
        a slot ``keeper`` lacks is taken over from it (the window KV just computed is kept)."""
        if self.slot_of[keeper] >= 0 or self.slot_of[duplicate] < 0:
            return
        self.slot_of[keeper] = self.slot_of[duplicate]
        self.slot_of[duplicate] = -1
        self._idle.pop(duplicate, None)
        self._tails.pop(duplicate, None)
        if self.held[keeper] == 0:
            self._idle[keeper] = None

    # ------------------------------------------------------------------ hits

    def usable_length(self, pages: Sequence[int], length: int) -> int:
        """The longest page-aligned prefix of ``length`` tokens in ``pages`` whose window (the
        pages a query right after it reads) still has every slot: 0 when none does."""
        p = self.page_size
        end = length // p
        while end > 0:
            first = self.first_needed(end * p)
            missing = [i for i in range(first, end) if self.slot_of[pages[i]] < 0]
            if not missing:
                return end * p
            end = missing[-1]  # a prefix ending before the last gap
        return 0

    # ------------------------------------------------------------------ integrity

    def check(self, owners: Sequence[int], holds: dict[int, int]) -> None:
        """Raise AssertionError unless each slot is free or owned by one page among
        ``owners`` (pages in the tree or a request), and ``holds`` (page -> how many handles
        hold it) is exactly what ``held`` says."""
        owned = np.flatnonzero(self.slot_of >= 0)
        slots = self.slot_of[owned]
        assert len(set(slots.tolist())) == len(slots), "a window slot is owned twice"
        for slot in slots.tolist():
            assert not self._slots.is_free(slot), f"window slot {slot} is owned and free"
        assert len(slots) + self._slots.num_free == self.num_slots, "a window slot is lost"
        owner_set = set(owners)
        for page in owned.tolist():
            assert page in owner_set, f"page {page} owns a window slot but is free"
        held = {int(p): int(self.held[p]) for p in np.flatnonzero(self.held)}
        assert held == holds, f"window holds {held} != the handles' {holds}"
        idle = {int(p) for p in owned.tolist() if self.held[p] == 0}
        assert self._idle.keys().isdisjoint(self._tails), "a page waits in both reclaim orders"
        waiting = set(self._idle) | set(self._tails)
        assert idle == waiting, "the reclaim orders differ from the unheld slots"
