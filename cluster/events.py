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

A remote store (``--kv-remote``) is not a place of one replica: every replica of the store can
load its pages. A replica announces the keys it knows to be there (it wrote or read them; a key
it found missing it takes back) as ``shared`` / ``unshared`` in a batch and ``shared`` in a
snapshot, apart from its own places, with the store's budget in pages (``shared_capacity``);
the router counts the most recently used of them, up to that budget, held by every replica at
the remote tier's cost (``PageTier.REMOTE``, which is never a replica's own place).

Schema 3 (2026-12-07) added ``shared`` / ``unshared``; schema 2 (2026-11-26) added ``host``
and ``disk`` to both records; schema 1 described the pool alone. The old fields keep a meaning an old consumer can live with: ``stored`` is every hash
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
    REMOTE = 3  # the store every replica shares (in a run, never one replica's own place)


OWN_TIERS = (PageTier.DEVICE, PageTier.HOST, PageTier.DISK)  # a replica's own places
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
    disk (the rest on the device). ``removed``: hashes held nowhere any more. ``shared`` /
    ``unshared``: hashes the replica just wrote to or read from the remote store (in that
    order) / found gone from it; the store keeps ``shared_capacity`` pages at most (0:
    unbounded or unknown).
    """

    replica: str
    epoch: int
    seq: int
    stored: list[int]
    removed: list[int]
    load: int = 0
    host: list[int] = []
    disk: list[int] = []
    shared: list[int] = []
    unshared: list[int] = []
    shared_capacity: int = 0


class KVSnapshot(msgspec.Struct, frozen=True):
    """Every page hash a replica holds, as of batch ``seq`` of ``epoch``: ``hashes`` all of
    them; of them, ``host`` only in host memory and ``disk`` only on disk; ``shared`` the
    hashes it knows to be in the remote store (held or not), which keeps ``shared_capacity``
    pages at most (0: unbounded or unknown)."""

    replica: str
    epoch: int
    seq: int
    hashes: list[int]
    host: list[int] = []
    disk: list[int] = []
    shared: list[int] = []
    shared_capacity: int = 0


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
        self._shared: set[int] = set()  # hashes known to be in the remote store
        # Since the last drain, in order of their last use: hash -> known (True) or taken back
        self._shared_news: dict[int, bool] = {}
        self.shared_capacity = 0  # pages the remote store keeps at most (0: unbounded, none)
        self._seq = 0

    def attach(self, kv: KVManager) -> None:
        """Follow ``kv`` from now on (call before it caches anything, or take a snapshot)."""
        remote = kv.tiers.remote if kv.tiers is not None else None
        if remote is not None:
            self.shared_capacity = remote.capacity_pages or 0
        kv.subscribe(self.on_event)

    def on_event(self, event: KVEvent) -> None:
        if isinstance(event, PagesStored):
            self._move(event.hashes, (), _BIT[PageTier.DEVICE])
        elif isinstance(event, PagesEvicted):
            self._move((), event.hashes, _BIT[PageTier.DEVICE])
        elif isinstance(event, TierChanged):
            if event.tier is Tier.REMOTE:
                self._share(event.added, event.removed)
            else:
                self._move(event.added, event.removed, _BIT[_OF_TIER[event.tier]])

    def _share(self, added: Iterable[int], removed: Iterable[int]) -> None:
        with self._lock:
            shared, news = self._shared, self._shared_news
            for h in removed:
                shared.discard(h)
                news.pop(h, None)
                news[h] = False
            for h in added:  # also pages known already: their use is news (the store's LRU)
                shared.add(h)
                news.pop(h, None)
                news[h] = True

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
            news = self._shared_news
            shared = [h for h, known in news.items() if known]
            unshared = [h for h, known in news.items() if not known]
            news.clear()
            if not stored and not removed and not shared and not unshared:
                return None
            self._seq += 1
            return KVEventBatch(
                self.replica, self.epoch, self._seq, stored, removed, load, host, disk,
                shared, unshared, self.shared_capacity,
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
            news = self._shared_news  # as of the last drain: the news undone
            shared = [h for h in self._shared if h not in news]
            # (a page known before and used since comes in the next batch again: the batch
            # after the snapshot restores exactly what is known now)
            seq = self._seq
        return KVSnapshot(
            self.replica,
            self.epoch,
            seq,
            list(held),
            [h for h, tier in held.items() if tier is PageTier.HOST],
            [h for h, tier in held.items() if tier is PageTier.DISK],
            shared,
            self.shared_capacity,
        )

    def where(self, h: int) -> PageTier | None:
        """Where the replica holds ``h`` now (not as of the last batch): the truth the events
        converge to."""
        with self._lock:
            return best_tier(self._places.get(h, 0))

    def tier_counts(self) -> dict[PageTier, int]:
        """Hashes held now, by their best place."""
        counts = dict.fromkeys(OWN_TIERS, 0)
        with self._lock:
            for places in self._places.values():
                tier = best_tier(places)
                assert tier is not None
                counts[tier] += 1
        return counts

    def shared(self) -> set[int]:
        """Hashes known to be in the remote store now (not as of the last batch)."""
        with self._lock:
            return set(self._shared)

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
