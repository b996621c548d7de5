"""A per-page LRU prefix cache, the hit-rate yardstick for the radix tree's eviction.

Pages are keyed by their prefix's hash chain in an OrderedDict. A request hits the longest
run of cached pages from its start. Touching walks tail to head, so the head of a prefix is
the most recent and a prefix's tail goes before its head (a head without its tail is still
useful, a tail without its head is not).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from radix.hashing import page_hashes


class PerPageLRU:
    def __init__(self, page_size: int, capacity_pages: int) -> None:
        self.page_size = page_size
        self.capacity = capacity_pages
        self._pages: OrderedDict[int, None] = OrderedDict()

    def request(self, prompt: np.ndarray, reply: np.ndarray) -> int:
        """Serve one request; returns the prompt tokens that hit."""
        prompt_chain = page_hashes(prompt, self.page_size)
        hit = 0
        for h in prompt_chain:
            if h not in self._pages:
                break
            hit += 1
        full_chain = page_hashes(np.concatenate([prompt, reply]), self.page_size)
        for h in reversed(full_chain):
            self._pages[h] = None
            self._pages.move_to_end(h)
        while len(self._pages) > self.capacity:
            self._pages.popitem(last=False)
        return hit * self.page_size
