"""radix: KV memory management for radixkv (pure Python, no torch, no model).

A paged KV pool is shared between requests by prefix: a radix tree of token ids maps every
cached page-aligned prefix onto the pool pages holding its KV, so a prompt that starts the way
an earlier one did reuses those pages instead of computing them again. Page ids are plain
ints; the tensors live with the engine.

``KVManager`` is the one way in. It owns the tree (``RadixCache``), the free list
(``PageAllocator``) and the KV tiers below the pool (``radix.tiers``), and gives each running
request one ``CacheHandle``: ``match`` (the cached prefix, nothing locked), ``acquire`` (it, locked),
``allocate``, ``cache``, ``release``, ``load`` (pages back from host memory or disk). Every page
is always in exactly one place (``KVManager.check``); whoever must follow the tree without
walking it subscribes to its ``PagesStored`` / ``PagesEvicted`` events. The tree and the
allocator are exported for reading and for their own tests: changing them by hand would bypass
that accounting. ``page_hashes`` gives a token sequence's content addresses without a tree
(what a router computes).
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
    TierLoad,
)
from radix.node import Node, PrefixInsert, PrefixMatch
from radix.pins import Pin

__all__ = [
    "CacheHandle",
    "KVEvent",
    "KVManager",
    "Node",
    "PageAllocator",
    "PageStats",
    "PagesEvicted",
    "PagesStored",
    "Pin",
    "PrefixInsert",
    "PrefixMatch",
    "RadixCache",
    "TierLoad",
    "page_hashes",
]
