"""radix: KV memory management for radixkv (pure Python, no torch).

KVManager owns a pool's pages: the prefix tree and the free list, and one CacheHandle per
running request. Under it, RadixCache maps page-aligned token prefixes to KV page ids,
PageAllocator hands out page ids, page_hashes gives the content address chain of a token
sequence without a tree. The tree and the allocator by hand:

    cache, allocator = RadixCache(page_size=16), PageAllocator(num_pages=4096)
    match = cache.match_prefix(prompt)            # cached pages of the longest prefix
    cache.lock(match.node)                        # nothing on that path is evicted now
    miss = len(prompt) // 16 - len(match.pages)
    if allocator.num_free < miss:                 # make room: LRU unlocked pages go first
        allocator.free(cache.evict(miss - allocator.num_free))
    new = allocator.alloc(miss)                   # None if locked pages fill the pool
    cached = cache.insert(prompt, match.pages + new)   # tokens that were cached already
    allocator.free(new[: cached // 16 - len(match.pages)])  # duplicates of the tree's pages
    cache.unlock(match.node)
"""

from __future__ import annotations

from radix.allocator import PageAllocator
from radix.cache import RadixCache
from radix.hashing import page_hashes
from radix.manager import (
    CacheHandle,
    KVEvent,
    KVManager,
    PagesEvicted,
    PagesStored,
    PageStats,
    TieredMatch,
    TierLoad,
)
from radix.node import Node, PrefixInsert, PrefixMatch

__all__ = [
    "CacheHandle",
    "KVEvent",
    "KVManager",
    "Node",
    "PageAllocator",
    "PageStats",
    "PagesEvicted",
    "PagesStored",
    "PrefixInsert",
    "PrefixMatch",
    "RadixCache",
    "TierLoad",
    "TieredMatch",
    "page_hashes",
]
