"""Whole-leaf eviction, the common alternative to ours, for the benchmark's comparison.

It frees every page of each LRU leaf it touches, so freeing one page can throw away a long
prefix. Only the benchmark uses it.
"""

from __future__ import annotations

from radix.cache import RadixCache


class WholeLeafEvictionCache(RadixCache):
    def evict(self, num_pages: int) -> list[int]:
        freed: list[int] = []
        while len(freed) < num_pages and self._lru:
            leaf = self._lru.peekitem(0)[1]
            # Evicting exactly the leaf's size makes the base class remove it whole.
            freed.extend(super().evict(len(leaf.pages)))
        return freed
