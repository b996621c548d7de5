"""The tree bench's replay: a trace through a RadixCache of a given capacity, as an engine
drives it (match, lock, allocate the miss evicting as needed, insert prompt + reply, free
duplicates, unlock), each cache call timed; and the hit rates of the yardsticks at the same
capacity (a per-page LRU, the same tree evicting whole leaves).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import numpy as np

from radix.allocator import PageAllocator
from radix.cache import RadixCache
from workloads.tree_bench.lru import PerPageLRU
from workloads.tree_bench.requests import TraceRequest
from workloads.tree_bench.whole_leaf import WholeLeafEvictionCache


@dataclass(slots=True)
class ReplayResult:
    hit_tokens: int = 0
    prompt_tokens: int = 0
    match_ns: list[int] = field(default_factory=list)
    insert_ns: list[int] = field(default_factory=list)
    evict_ns: list[int] = field(default_factory=list)
    evict_ns_per_step: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)


def unique_pages(trace: list[TraceRequest], page_size: int) -> int:
    """Pages an infinite cache ends up holding for the whole trace."""
    cache = RadixCache(page_size)
    for req in trace:
        full = np.concatenate([req.prompt, req.reply])
        n = len(full) // page_size
        cache.insert(full, list(range(n)))  # page ids are irrelevant here
    return cache.cached_pages


def replay(trace: list[TraceRequest], page_size: int, capacity: int) -> ReplayResult:
    """Serve the trace through a cache of ``capacity`` pages, timing each cache call.

    The garbage collector is paused during the replay (as timeit does) so a collection
    triggered by an unrelated allocation does not land in one call's timing.
    """
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay(trace, page_size, capacity)
    finally:
        if gc_was_enabled:
            gc.enable()


def _replay(
    trace: list[TraceRequest],
    page_size: int,
    capacity: int,
    cache_type: type[RadixCache] = RadixCache,
) -> ReplayResult:
    cache = cache_type(page_size)
    allocator = PageAllocator(capacity)
    result = ReplayResult()
    clock = time.perf_counter_ns
    fulls = [np.concatenate([req.prompt, req.reply]) for req in trace]
    freed: list[int] = []
    for req, full in zip(trace, fulls):
        t0 = clock()
        match = cache.match_prefix(req.prompt)
        t1 = clock()
        result.match_ns.append(t1 - t0)
        result.hit_tokens += match.length
        result.prompt_tokens += len(req.prompt)
        cache.lock(match.node)
        own = len(match.pages)
        miss = len(full) // page_size - own
        short = miss - allocator.num_free
        if short > 0:
            steps = cache.stats["eviction_steps"]
            t0 = clock()
            freed = cache.evict(short)
            t1 = clock()
            result.evict_ns.append(t1 - t0)
            result.evict_ns_per_step.append((t1 - t0) / (cache.stats["eviction_steps"] - steps))
            allocator.free(freed)
        new_pages = allocator.alloc(miss)
        if new_pages is None:  # cannot happen with capacity >= the largest request
            raise RuntimeError(f"capacity {capacity} pages cannot hold a {miss}-page request")
        held = match.pages + new_pages
        t0 = clock()
        cached = cache.insert(full, held)
        t1 = clock()
        result.insert_ns.append(t1 - t0)
        allocator.free(new_pages[: cached // page_size - own])
        cache.unlock(match.node)
        # Drop the results here, outside the timed calls: rebinding these names at the next
        # call would otherwise free a list of thousands of page ids inside its timing.
        del match, held, new_pages
        freed = []
    cache.check_invariants()
    assert allocator.num_free + cache.cached_pages == allocator.num_pages
    return result


def whole_leaf_hit_rate(trace: list[TraceRequest], page_size: int, capacity: int) -> float:
    return _replay(trace, page_size, capacity, WholeLeafEvictionCache).hit_rate


def per_page_lru_hit_rate(trace: list[TraceRequest], page_size: int, capacity: int) -> float:
    lru = PerPageLRU(page_size, capacity)
    hit = total = 0
    for req in trace:
        hit += lru.request(req.prompt, req.reply)
        total += len(req.prompt)
    return hit / total
