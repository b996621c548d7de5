"""The host tier: page records in process memory under a byte budget, least recently used
out first (to the disk tier, when there is one)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from radix.tiers.changes import StoreWatcher
from radix.tiers.record import PageRecord


class HostStore:
    """Page records by key, within ``budget_bytes`` of KV data.

    ``put`` returns the records it pushed out (oldest first) so the caller can write them
    further down; nothing here knows about disks. Every change of its keys goes to the
    watcher (``watch``), so KV events can say where a page is.
    """

    def __init__(self, budget_bytes: int) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes: must be an int >= 0, got {budget_bytes!r}")
        self._budget = budget_bytes
        self._records: OrderedDict[int, PageRecord] = OrderedDict()
        self._used = 0
        self._watcher: StoreWatcher | None = None

    def watch(self, watcher: StoreWatcher | None) -> None:
        """Call ``watcher(added, removed)`` with every change of the keys held from now on."""
        self._watcher = watcher

    def _changed(self, added: Sequence[int], removed: Sequence[int]) -> None:
        if self._watcher is not None and (added or removed):
            self._watcher(added, removed)

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: int) -> bool:
        return key in self._records

    def keys(self) -> list[int]:
        return list(self._records)

    def get(self, key: int) -> PageRecord | None:
        """The record (now the most recently used), or None."""
        record = self._records.get(key)
        if record is not None:
            self._records.move_to_end(key)
        return record

    def touch(self, key: int) -> None:
        if key in self._records:
            self._records.move_to_end(key)

    def put(self, record: PageRecord) -> list[PageRecord]:
        """Keep ``record`` (a key already held is only refreshed); returns the records that
        no longer fit, oldest first (``record`` itself when it is larger than the budget)."""
        if record.key in self._records:
            self._records.move_to_end(record.key)
            return []
        if record.nbytes > self._budget:
            return [record]
        out: list[PageRecord] = []
        while self._used + record.nbytes > self._budget:
            _, old = self._records.popitem(last=False)
            self._used -= old.nbytes
            out.append(old)
        self._records[record.key] = record
        self._used += record.nbytes
        self._changed((record.key,), [old.key for old in out])
        return out

    def pop(self, key: int) -> PageRecord | None:
        record = self._records.pop(key, None)
        if record is not None:
            self._used -= record.nbytes
            self._changed((), (key,))
        return record

    def drain(self) -> list[PageRecord]:
        """Every record, oldest first; the store is empty afterwards."""
        out = list(self._records.values())
        self._records.clear()
        self._used = 0
        self._changed((), [record.key for record in out])
        return out

    def check(self) -> None:
        used = sum(record.nbytes for record in self._records.values())
        assert used == self._used, f"host: {self._used} bytes counted, {used} held"
        assert self._used <= self._budget, f"host: {self._used} bytes over {self._budget}"
        for key, record in self._records.items():
            assert record.key == key, "host: a record filed under another key"
