"""KV tiers for the cache-only simulators: the real ``KVTiers`` (host store, disk store,
remote store, load-or-recompute) under a pool whose pages hold no KV.

The simulators have no model, so a page's "KV" is a few zero bytes (``PAGE_BYTES``): budgets
are counted in pages, the disk store writes real files (in a temporary directory, on tmpfs
where there is one), and nothing is timed. What the tiers decide (what is written down, what
moves to disk, what is dropped, what a prompt loads back) is what an engine's tiers decide.
"""

from __future__ import annotations

import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from radix.tiers import DiskStore, HostStore, KVTiers, PageRecord, RemoteStore
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


class SharedPages:
    """The remote store's server for the simulators: values by key, the least recently
    written or read dropped beyond ``pages`` (a ``RemoteClient``, shared by every replica)."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.evicted = 0
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            values = self._values
            found = [values.get(key) for key in keys]
            for key, value in zip(keys, found):
                if value is not None:
                    values.move_to_end(key)
            return found

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        with self._lock:
            values = self._values
            for key, value in items:
                values[key] = value
                values.move_to_end(key)
            while len(values) > self.pages:
                values.popitem(last=False)
                self.evicted += 1

    def close(self) -> None:
        pass


class SimTiers:
    """Host and disk stores of ``host_pages`` and ``disk_pages`` pages for each of several
    pools (one directory per pool, removed by ``close``), and one remote store of
    ``remote_pages`` they all share."""

    def __init__(
        self, page_size: int, host_pages: int, disk_pages: int, remote_pages: int = 0
    ) -> None:
        self.page_size = page_size
        self.host_pages = host_pages
        self.disk_pages = disk_pages
        self.shared = SharedPages(remote_pages) if remote_pages else None
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
        remote = None
        if self.shared is not None:
            remote = RemoteStore(self.shared, "sim", capacity_pages=self.shared.pages)
        if host is None and disk is None and remote is None:
            return None
        tiers = KVTiers(NoKV(), self.page_size, host, disk, remote)
        self._made.append(tiers)
        return tiers

    def settle(self) -> None:
        """Wait for every replica's queued remote writes (once a step: runs repeat)."""
        for tiers in self._made:
            if tiers.remote is not None and not tiers.remote.flush():
                raise RuntimeError("simulated remote store: writes did not finish")

    def close(self) -> None:
        for tiers in self._made:
            tiers.close()
        self._made.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
