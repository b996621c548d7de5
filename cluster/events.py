"""KV events a replica publishes: which page hashes it holds, where (device, host, disk), and
which it dropped.

A replica's ``KVEventPublisher`` follows its ``KVManager``: ``PagesStored`` / ``PagesEvicted``
(the pool) and, with KV tiers, ``TierChanged`` (host memory, disk), each with the pages'
content addresses. It hands out numbered batches: the net change since the previous batch. A
consumer that sees ``seq`` jump, or a new ``epoch`` (the replica restarted), asks for a
``KVSnapshot`` and starts over from it.

Where a page is: its best place, ``PageTier.DEVICE`` (the pool) before ``HOST`` before
``DISK``. A page evicted from the pool but written down has moved, not gone; a page loaded
back is on the device again; a page gone from every place is removed.

Schema 2 (2026-11-26) added ``host`` and ``disk`` to both records; schema 1 described the pool
alone. The old fields keep a meaning an old consumer can live with: ``stored`` is every hash
newly held, or held in a new place, wherever it now is, ``removed`` every hash held nowhere
any more, a snapshot's ``hashes`` everything held. So a schema-1 consumer treats a page below
the pool as held (the replica can load it: cheaper than recomputing), and a schema-2
consumer reading a schema-1 record (``host``/``disk`` empty) sees every page on the device,
which is what that record meant.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from enum import IntEnum

import msgspec

from radix import KVEvent, KVManager, PagesEvicted, PagesStored
from radix.tiers import Tier, TierChanged


class PageTier(IntEnum):
    """Where a replica holds a page, cheapest to use first."""

    DEVICE = 0
    HOST = 1
    DISK = 2


_BIT = {PageTier.DEVICE: 1, PageTier.HOST: 2, PageTier.DISK: 4}
_OF_TIER = {Tier.HOST: PageTier.HOST, Tier.DISK: PageTier.DISK}


def best_tier(places: int) -> PageTier | None:
    """The cheapest place in a bit set of places (None: the set is empty)."""
    if places & 1:
        return PageTier.DEVICE
    if places & 2:
        return PageTier.HOST
    if places & 4:
        return PageTier.DISK
    return None


class KVEventBatch(msgspec.Struct, frozen=True):
    """The net change of one replica's page hashes between two drains.

    ``seq`` counts batches from 1 within an ``epoch``; ``load`` is the replica's queue
    (running + waiting requests) when the batch was cut. ``stored``: hashes newly held or
    held in a new place; of them, ``host`` are now only in host memory and ``disk`` only on
    disk (the rest on the device). ``removed``: hashes held nowhere any more.
    """

    replica: str
    epoch: int
    seq: int
    stored: list[int]
    removed: list[int]
    load: int = 0
    host: list[int] = []
    disk: list[int] = []


class KVSnapshot(msgspec.Struct, frozen=True):
    """Every page hash a replica holds, as of batch ``seq`` of ``epoch``: ``hashes`` all of
    them; of them, ``host`` only in host memory and ``disk`` only on disk."""

    replica: str
    epoch: int
    seq: int
    hashes: list[int]
    host: list[int] = []
    disk: list[int] = []


def tiers_of(record: KVEventBatch | KVSnapshot) -> dict[int, PageTier]:
    """The hashes of ``record`` that are below the device, with their place."""
    below = dict.fromkeys(record.host, PageTier.HOST)
    below.update(dict.fromkeys(record.disk, PageTier.DISK))
    return below


def kv_places(kv: KVManager) -> dict[int, PageTier]:
    """What ``kv`` holds, each page at its best place, read from the tree and the stores (a
    walk of them all: the truth a publisher's events converge to, for checks)."""
    truth: dict[int, PageTier] = {}
    tiers = kv.tiers
    if tiers is not None:
        for store, tier in ((tiers.disk, PageTier.DISK), (tiers.host, PageTier.HOST)):
            if store is not None:
                truth.update(dict.fromkeys(store.keys(), tier))
    truth.update((page.key, PageTier.DEVICE) for page in kv.tree.walk_pages())
    return truth


class KVEventPublisher:
    """Turns one KVManager's events into numbered, netted batches of page hashes.

    Events arrive on the engine loop's thread; ``drain`` and ``snapshot`` may be called from
    any other, so the state sits behind one lock. The publisher keeps every hash's places
    (a bit set per held page) so a snapshot never has to walk the tree or the stores.
    """

    def __init__(self, replica: str, epoch: int | None = None) -> None:
        self.replica = replica
        self.epoch = epoch if epoch is not None else random.getrandbits(48)
        self._lock = threading.Lock()
        self._places: dict[int, int] = {}  # hash -> bit set of its places (never 0)
        self._touched: dict[int, PageTier | None] = {}  # hash -> its place at the last drain
        self._seq = 0

    def attach(self, kv: KVManager) -> None:
        """Follow ``kv`` from now on (call before it caches anything, or take a snapshot)."""
        kv.subscribe(self.on_event)

    def on_event(self, event: KVEvent) -> None:
        if isinstance(event, PagesStored):
            self._move(event.hashes, (), _BIT[PageTier.DEVICE])
        elif isinstance(event, PagesEvicted):
            self._move((), event.hashes, _BIT[PageTier.DEVICE])
        elif isinstance(event, TierChanged):
            self._move(event.added, event.removed, _BIT[_OF_TIER[event.tier]])

    def _move(self, added: Iterable[int], removed: Iterable[int], bit: int) -> None:
        with self._lock:
            places, touched = self._places, self._touched
            for h in added:
                held = places.get(h, 0)
                if h not in touched:
                    touched[h] = best_tier(held)
                places[h] = held | bit
            for h in removed:
                held = places.get(h, 0)
                if h not in touched:
                    touched[h] = best_tier(held)
                if held & ~bit:
                    places[h] = held & ~bit
                elif held:
                    del places[h]

    def drain(self, load: int = 0) -> KVEventBatch | None:
        """The net change since the last drain as the next batch; None when nothing changed."""
        with self._lock:
            stored: list[int] = []
            removed: list[int] = []
            host: list[int] = []
            disk: list[int] = []
            places = self._places
            for h, was in self._touched.items():
                now = best_tier(places.get(h, 0))
                if now is was:
                    continue
                if now is None:
                    removed.append(h)
                    continue
                stored.append(h)
                if now is PageTier.HOST:
                    host.append(h)
                elif now is PageTier.DISK:
                    disk.append(h)
            self._touched.clear()
            if not stored and not removed:
                return None
            self._seq += 1
            return KVEventBatch(
                self.replica, self.epoch, self._seq, stored, removed, load, host, disk
            )

    def snapshot(self) -> KVSnapshot:
        """Every hash held as of the last batch drained (changes since then come in the next)."""
        with self._lock:
            touched = self._touched
            held = {
                h: tier
                for h, places in self._places.items()
                if h not in touched and (tier := best_tier(places)) is not None
            }
            held.update((h, was) for h, was in touched.items() if was is not None)
            seq = self._seq
        return KVSnapshot(
            self.replica,
            self.epoch,
            seq,
            list(held),
            [h for h, tier in held.items() if tier is PageTier.HOST],
            [h for h, tier in held.items() if tier is PageTier.DISK],
        )

    def where(self, h: int) -> PageTier | None:
        """Where the replica holds ``h`` now (not as of the last batch): the truth the events
        converge to."""
        with self._lock:
            return best_tier(self._places.get(h, 0))

    def tier_counts(self) -> dict[PageTier, int]:
        """Hashes held now, by their best place."""
        counts = dict.fromkeys(PageTier, 0)
        with self._lock:
            for places in self._places.values():
                tier = best_tier(places)
                assert tier is not None
                counts[tier] += 1
        return counts

    @property
    def seq(self) -> int:
        """The last batch drained (0: none yet)."""
        with self._lock:
            return self._seq

    @property
    def num_hashes(self) -> int:
        """Hashes held now, in any place."""
        with self._lock:
            return len(self._places)
