"""KV events a replica publishes: which page hashes it now holds and which it dropped.

A replica's ``KVEventPublisher`` follows its ``KVManager`` (``PagesStored`` /
``PagesEvicted``, each with the pages' content addresses) and hands out numbered batches:
the net change since the previous batch. A consumer that sees ``seq`` jump, or a new
``epoch`` (the replica restarted), asks for a ``KVSnapshot`` and starts over from it.
"""

from __future__ import annotations

import random
import threading

import msgspec

from radix import KVEvent, KVManager, PagesStored


class KVEventBatch(msgspec.Struct, frozen=True):
    """The net change of one replica's cached page hashes between two drains.

    ``seq`` counts batches from 1 within an ``epoch``; ``load`` is the replica's queue
    (running + waiting requests) when the batch was cut.
    """

    replica: str
    epoch: int
    seq: int
    stored: list[int]
    removed: list[int]
    load: int = 0


class KVSnapshot(msgspec.Struct, frozen=True):
    """Every page hash a replica holds, as of batch ``seq`` of ``epoch``."""

    replica: str
    epoch: int
    seq: int
    hashes: list[int]


class KVEventPublisher:
    """Turns one KVManager's events into numbered, netted batches of page hashes.

    Events arrive on the engine loop's thread; ``drain`` and ``snapshot`` may be called from
    any other, so the state sits behind one lock. The publisher keeps the set of live hashes
    (one int per cached page) so a snapshot never has to walk the tree.
    """

    def __init__(self, replica: str, epoch: int | None = None) -> None:
        self.replica = replica
        self.epoch = epoch if epoch is not None else random.getrandbits(48)
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._touched: dict[int, bool] = {}  # hash -> was it live at the last drain
        self._seq = 0

    def attach(self, kv: KVManager) -> None:
        """Follow ``kv`` from now on (call before it caches anything, or take a snapshot)."""
        kv.subscribe(self.on_event)

    def on_event(self, event: KVEvent) -> None:
        stored = isinstance(event, PagesStored)
        with self._lock:
            live, touched = self._live, self._touched
            for h in event.hashes:
                if h not in touched:
                    touched[h] = h in live
                if stored:
                    live.add(h)
                else:
                    live.discard(h)

    def drain(self, load: int = 0) -> KVEventBatch | None:
        """The net change since the last drain as the next batch; None when nothing changed."""
        with self._lock:
            live, touched = self._live, self._touched
            stored = [h for h, was in touched.items() if not was and h in live]
            removed = [h for h, was in touched.items() if was and h not in live]
            touched.clear()
            if not stored and not removed:
                return None
            self._seq += 1
            return KVEventBatch(self.replica, self.epoch, self._seq, stored, removed, load)

    def snapshot(self) -> KVSnapshot:
        """Every hash held as of the last batch drained (changes since then come in the next)."""
        with self._lock:
            held = [h for h in self._live if self._touched.get(h, True)]
            held.extend(h for h, was in self._touched.items() if was and h not in self._live)
            return KVSnapshot(self.replica, self.epoch, self._seq, held)

    @property
    def seq(self) -> int:
        """The last batch drained (0: none yet)."""
        with self._lock:
            return self._seq

    @property
    def num_hashes(self) -> int:
        with self._lock:
            return len(self._live)
