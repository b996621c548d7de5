"""Free list of KV page ids."""

from __future__ import annotations

from array import array
from collections.abc import Iterable


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1``; catches double frees and unknown pages.

    Allocation is all-or-nothing so a caller never holds half of what it asked for.
    """

    __slots__ = ("_num_pages", "_free", "_free_set")

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
            raise ValueError(f"num_pages: must be an int >= 0, got {num_pages!r}")
        self._num_pages = num_pages
        # A stack: popping from the end gives 0, 1, 2, ... on a fresh allocator.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_set: set[int] = set(self._free)

    @property
    def num_pages(self) -> int:
        """Total pages managed (free or not)."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_pages - len(self._free)

    def is_free(self, page: int) -> bool:
        return page in self._free_set

    def alloc(self, n: int) -> list[int] | None:
        """``n`` page ids, or None (and nothing taken) when fewer than ``n`` are free."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: must be an int >= 0, got {n!r}")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        self._free_set.difference_update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list; raises ValueError (freeing nothing) on bad ids."""
        try:
            # array() converts in C and rejects floats, strings and None (TypeError) and
            # values beyond int64 (OverflowError); numpy integers pass through __index__.
            ids = array("q", pages)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"pages: expected int page ids ({exc})") from None
        if not ids:
            return
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self._num_pages:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"pages: unknown page id {bad} (valid ids are 0..{self._num_pages - 1})"
            )
        unique = set(ids)
        if len(unique) != len(ids):
            raise ValueError("pages: the same page id appears twice in one free() call")
        if not self._free_set.isdisjoint(unique):
            bad = min(self._free_set & unique)
            raise ValueError(f"pages: double free of page {bad} (it is already free)")
        self._free_set.update(unique)
        ids.reverse()
        self._free.extend(ids)

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self._num_pages}, num_free={self.num_free})"
