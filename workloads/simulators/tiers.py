"""KV tiers for the cache-only simulators: the real ``KVTiers`` (host store, disk store,
load-or-recompute) under a pool whose pages hold no KV.

The simulators have no model, so a page's "KV" is a few zero bytes (``PAGE_BYTES``): budgets
are counted in pages, the disk store writes real files (in a temporary directory, on tmpfs
where there is one), and nothing is timed. What the tiers decide (what is written down, what
moves to disk, what is dropped, what a prompt loads back) is what an engine's tiers decide.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from radix.tiers import DiskStore, HostStore, KVTiers, PageRecord
from radix.tiers.disk import file_size
from radix.tokens import TOKEN_BYTES

PAGE_BYTES = 8  # a page's stand-in KV
_SHM = Path("/dev/shm")


class NoKV:
    """The ``PageIO`` of a pool without tensors: every page reads as ``PAGE_BYTES`` zeros."""

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        return [bytes(PAGE_BYTES)] * len(pages)

    def write_pages(self, pages: Sequence[int], data: Sequence[bytes]) -> None:
        pass


class SimTiers:
    """Host and disk stores of ``host_pages`` and ``disk_pages`` pages for each of several
    pools (one directory per pool, removed by ``close``)."""

    def __init__(self, page_size: int, host_pages: int, disk_pages: int) -> None:
        self.page_size = page_size
        self.host_pages = host_pages
        self.disk_pages = disk_pages
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._made: list[KVTiers] = []

    def make(self, name: str) -> KVTiers | None:
        """The tiers of one pool (None when neither tier has room)."""
        host = HostStore(self.host_pages * PAGE_BYTES) if self.host_pages else None
        disk = None
        if self.disk_pages:
            if self._dir is None:
                root = _SHM if _SHM.is_dir() else None
                self._dir = tempfile.TemporaryDirectory(prefix="radixkv-sim-", dir=root)
            sample = PageRecord(0, bytes(self.page_size * TOKEN_BYTES), bytes(PAGE_BYTES))
            disk = DiskStore(self._dir.name, self.disk_pages * file_size(sample), name)
        if host is None and disk is None:
            return None
        tiers = KVTiers(NoKV(), self.page_size, host, disk)
        self._made.append(tiers)
        return tiers

    def close(self) -> None:
        for tiers in self._made:
            tiers.close()
        self._made.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
