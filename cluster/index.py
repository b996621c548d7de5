"""The router's view of every replica's cache: page hash -> the replicas holding it, and
where each holds it (device, host memory, disk).

Built only from the replicas' KV events, so it holds exactly what they hold (as of their
last batch): its size is bounded by the replicas' KV pools and tiers, and a hash is forgotten
as soon as its last holder drops it from its last tier. A batch out of sequence marks the replica stale (its view is
kept, since it is still mostly right) until a snapshot resyncs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cluster.events import KVEventBatch, KVSnapshot, PageTier, tiers_of


@dataclass
class ReplicaView:
    """What the index knows of one replica: ``hashes`` held anywhere; of them, ``below``
    the ones held only below the device (host memory or disk), with their place."""

    epoch: int | None = None
    seq: int = 0
    hashes: set[int] = field(default_factory=set)
    stale: bool = True  # no snapshot yet, or a batch went missing
    load: int = 0
    below: dict[int, PageTier] = field(default_factory=dict)

    def where(self, h: int) -> PageTier | None:
        if h not in self.hashes:
            return None
        return self.below.get(h, PageTier.DEVICE)

    def tier_counts(self) -> dict[PageTier, int]:
        """Hashes held, by their place."""
        counts = dict.fromkeys(PageTier, 0)
        for tier in self.below.values():
            counts[tier] += 1
        counts[PageTier.DEVICE] = len(self.hashes) - len(self.below)
        return counts


class KVIndex:
    """Page hashes of many replicas, for longest-prefix lookups."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaView] = {}
        self._holders: dict[int, set[str]] = {}
        self.gaps = 0  # batches that arrived out of sequence
        self.resyncs = 0

    # --------------------------------------------------------------------- updates

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply the replica's next batch. False when it is not the next one (a gap, a new
        epoch, or a replica never snapshotted): the replica is stale until ``resync``. A batch
        already applied is ignored (True)."""
        view = self._replicas.setdefault(batch.replica, ReplicaView())
        view.load = batch.load
        if view.epoch == batch.epoch and batch.seq <= view.seq:
            return True
        if view.stale or view.epoch != batch.epoch or batch.seq != view.seq + 1:
            if not view.stale:
                self.gaps += 1
            view.stale = True
            return False
        self._add(batch.replica, view, batch.stored, tiers_of(batch))
        self._drop(batch.replica, view, batch.removed)
        view.seq = batch.seq
        return True

    def resync(self, snapshot: KVSnapshot) -> None:
        """Replace the replica's view with ``snapshot``; batches after its ``seq`` follow."""
        view = self._replicas.setdefault(snapshot.replica, ReplicaView())
        self._drop(snapshot.replica, view, list(view.hashes))
        self._add(snapshot.replica, view, snapshot.hashes, tiers_of(snapshot))
        view.epoch, view.seq, view.stale = snapshot.epoch, snapshot.seq, False
        self.resyncs += 1

    def remove_replica(self, replica: str) -> None:
        view = self._replicas.pop(replica, None)
        if view is not None:
            self._drop(replica, view, list(view.hashes))

    def _add(
        self,
        replica: str,
        view: ReplicaView,
        hashes: Iterable[int],
        below: dict[int, PageTier],
    ) -> None:
        """``hashes`` held now, on the device unless ``below`` names their place."""
        holders, places = self._holders, view.below
        for h in hashes:
            view.hashes.add(h)
            holders.setdefault(h, set()).add(replica)
            tier = below.get(h)
            if tier is None:
                places.pop(h, None)
            else:
                places[h] = tier

    def _drop(self, replica: str, view: ReplicaView, hashes: Iterable[int]) -> None:
        holders = self._holders
        for h in hashes:
            view.hashes.discard(h)
            view.below.pop(h, None)
            owners = holders.get(h)
            if owners is not None:
                owners.discard(replica)
                if not owners:
                    del holders[h]

    # --------------------------------------------------------------------- queries

    def prefix_pages(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each replica holding the first page (in any place): how many leading pages of
        the chain ``hashes`` it holds (a chain hash names its whole prefix, so the run is a
        prefix)."""
        depth: dict[str, int] = {}
        holders = self._holders
        for i, h in enumerate(hashes):
            owners = holders.get(h)
            if not owners:
                break
            advanced = False
            for replica in owners:
                if depth.get(replica, 0) == i:
                    depth[replica] = i + 1
                    advanced = True
            if not advanced:
                break
        return depth

    def prefix_tiers(
        self, hashes: Sequence[int], below: bool = True
    ) -> dict[str, list[PageTier]]:
        """For each replica holding the first page: the places of its leading run of
        ``hashes``. ``below=False`` counts device pages only (the run ends at the first page
        not in the pool: what a router blind to the tiers sees)."""
        runs: dict[str, list[PageTier]] = {}
        for replica, n in self.prefix_pages(hashes).items():
            places = self._replicas[replica].below
            run = [places.get(h, PageTier.DEVICE) for h in hashes[:n]]
            if not below and places:
                end = next((i for i, t in enumerate(run) if t is not PageTier.DEVICE), n)
                run = run[:end]
            if run:
                runs[replica] = run
        return runs

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def view(self, replica: str) -> ReplicaView | None:
        return self._replicas.get(replica)

    def held(self, replica: str) -> int:
        """How many pages the replica holds on the device (0 for one never heard of)."""
        view = self._replicas.get(replica)
        return len(view.hashes) - len(view.below) if view is not None else 0

    def stale(self) -> list[str]:
        """Replicas waiting for a snapshot."""
        return [name for name, view in self._replicas.items() if view.stale]

    @property
    def num_hashes(self) -> int:
        """Distinct hashes held (the index's memory is linear in this and in the views)."""
        return len(self._holders)

    def check(self) -> None:
        """The two directions agree: a hash lists exactly the replicas whose view holds it."""
        for h, owners in self._holders.items():
            assert owners, f"hash {h:#x} kept with no holder"
            for replica in owners:
                assert h in self._replicas[replica].hashes, f"{replica} listed for {h:#x}"
        total = sum(len(view.hashes) for view in self._replicas.values())
        assert total == sum(len(owners) for owners in self._holders.values())
        for replica, view in self._replicas.items():
            stray = view.below.keys() - view.hashes
            assert not stray, f"{replica}: {len(stray)} hashes placed below but not held"
            assert PageTier.DEVICE not in view.below.values(), f"{replica}: device as below"
