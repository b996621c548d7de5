"""The KV event hub: replicas publish their batches here, routers pull them.

Replicas cannot call a router (it lives in Ray Serve's proxy or in a handle's process) and a
router should not wait on every replica per request, so the batches meet in one small actor.
The hub mirrors every replica's hashes in a ``KVIndex`` of its own, which is what lets it
answer a router that fell behind (or just started) with a snapshot instead of the batches it
no longer keeps. When the hub itself misses a batch, ``publish`` says so and the replica
sends its own snapshot.

Plain Python: ``cluster.serve`` runs it as a Ray actor; tests call it directly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from cluster.events import KVEventBatch, KVSnapshot, PageTier
from cluster.index import KVIndex, ReplicaView


def snapshot_of(replica: str, view: ReplicaView) -> KVSnapshot:
    """The hub's mirror of one replica as a snapshot, places included."""
    assert view.epoch is not None, "a replica never snapshotted has nothing to offer"
    host = sorted(h for h, tier in view.below.items() if tier is PageTier.HOST)
    disk = sorted(h for h, tier in view.below.items() if tier is PageTier.DISK)
    return KVSnapshot(
        replica, view.epoch, view.seq, sorted(view.hashes), host, disk, sorted(view.shared)
    )


class HubPull(msgspec.Struct, frozen=True):
    """What a router is missing: batches past its cursors, or snapshots where it is too far
    behind; ``replicas`` lists every replica the hub follows, with its latest load."""

    updates: list[KVEventBatch | KVSnapshot]
    loads: dict[str, int]


# A replica reports its stats every 0.5 s, busy or idle; one silent this long is gone (Serve
# replaced a killed replica without its ``forget``): its stats and hashes are dropped.
SILENT_S = 10.0


class EventHub:
    """Keeps the last ``keep`` batches of each replica and a mirror of all their hashes."""

    def __init__(
        self,
        keep: int = 256,
        silent_s: float = SILENT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keep = keep
        self._index = KVIndex()
        self._recent: dict[str, deque[KVEventBatch]] = {}
        self._stats: dict[str, Any] = {}
        self._heard: dict[str, float] = {}  # replica -> when its stats last came
        self._silent_s = silent_s
        self._clock = clock
        self._closing = False  # shutting down: replicas close their engines

    def publish(self, batch: KVEventBatch) -> bool:
        """Take a replica's next batch; False: the hub lost track, send ``publish_snapshot``."""
        view = self._index.view(batch.replica)
        duplicate = view is not None and view.epoch == batch.epoch and batch.seq <= view.seq
        if not self._index.apply(batch):
            return False
        if not duplicate:
            recent = self._recent.setdefault(batch.replica, deque(maxlen=self._keep))
            recent.append(batch)
        return True

    def publish_snapshot(self, snapshot: KVSnapshot) -> None:
        self._index.resync(snapshot)
        self._recent[snapshot.replica] = deque(maxlen=self._keep)

    def publish_stats(self, replica: str, stats: Any) -> bool:
        """A replica's latest engine stats (any picklable record), for the front end;
        returns whether the replicas are to close their engines (``close_replicas``)."""
        self._stats[replica] = stats
        self._heard[replica] = self._clock()
        return self._closing

    def close_replicas(self) -> None:
        """Shutting down, the grace period over: every replica closes its engine at its next
        report (every 0.5 s), which ends what it still runs with finish_reason "abort"."""
        self._closing = True

    def forget(self, replica: str) -> None:
        """The replica is gone: its hashes leave the mirror and, at the next pull, the routers."""
        self._index.remove_replica(replica)
        self._recent.pop(replica, None)
        self._stats.pop(replica, None)
        self._heard.pop(replica, None)

    def pull(self, cursors: dict[str, tuple[int, int]]) -> HubPull:
        """Everything past each ``(epoch, seq)`` cursor, by replica."""
        updates: list[KVEventBatch | KVSnapshot] = []
        loads: dict[str, int] = {}
        for replica in self._index.replicas():
            view = self._index.view(replica)
            assert view is not None
            if view.stale or view.epoch is None:
                continue
            loads[replica] = view.load
            cursor = cursors.get(replica)
            if cursor == (view.epoch, view.seq):
                continue
            recent = self._recent.get(replica) or deque()
            if (
                cursor is not None
                and cursor[0] == view.epoch
                and recent
                and recent[0].seq <= cursor[1] + 1
            ):
                updates.extend(b for b in recent if b.seq > cursor[1])
            else:
                updates.append(snapshot_of(replica, view))
        return HubPull(updates, loads)

    def stats(self) -> dict[str, Any]:
        """The latest stats of every replica heard from within ``silent_s``; the silent
        ones are forgotten (a replica killed without saying so)."""
        now = self._clock()
        for replica, heard in list(self._heard.items()):
            if now - heard > self._silent_s:
                self.forget(replica)
        return dict(self._stats)

    def num_hashes(self) -> int:
        return self._index.num_hashes
