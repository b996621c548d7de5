"""The router's view of every replica's cache: page hash -> the replicas holding it, and
where each holds it (device, host memory, disk); and the hashes in the remote store that
every replica shares (each vouched for by the replicas that announced it), in the order of
their last use, trimmed to the store's budget: the store evicts its least recently used
pages without telling anyone, so the index forgets what the store would have dropped.

Built only from the replicas' KV events, so it holds exactly what they hold (as of their
last batch): its size is bounded by the replicas' KV pools and tiers, and a hash is forgotten
as soon as its last holder drops it from its last tier. A batch out of sequence marks the replica stale (its view is
kept, since it is still mostly right) until a snapshot resyncs it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cluster.events import OWN_TIERS, KVEventBatch, KVSnapshot, PageTier, tiers_of


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
    shared: set[int] = field(default_factory=set)  # hashes it says are in the remote store
    shared_capacity: int = 0  # pages that store keeps at most (0: unbounded or unknown)

    def where(self, h: int) -> PageTier | None:
        if h not in self.hashes:
            return None
        return self.below.get(h, PageTier.DEVICE)

    def tier_counts(self) -> dict[PageTier, int]:
        """Hashes held, by their place."""
        counts = dict.fromkeys(OWN_TIERS, 0)
        for tier in self.below.values():
            counts[tier] += 1
        counts[PageTier.DEVICE] = len(self.hashes) - len(self.below)
        return counts


class KVIndex:
    """Page hashes of many replicas, for longest-prefix lookups."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaView] = {}
        self._holders: dict[int, set[str]] = {}
        # remote-store hash -> replicas vouching for it, least recently used first
        self._shared: OrderedDict[int, set[str]] = OrderedDict()
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
        self._unvouch(batch.replica, view, batch.unshared)
        self._vouch(batch.replica, view, batch.shared)
        view.shared_capacity = batch.shared_capacity
        self._trim_shared()
        view.seq = batch.seq
        return True

    def resync(self, snapshot: KVSnapshot) -> None:
        """Replace the replica's view with ``snapshot``; batches after its ``seq`` follow."""
        view = self._replicas.setdefault(snapshot.replica, ReplicaView())
        self._drop(snapshot.replica, view, list(view.hashes))
        self._unvouch(snapshot.replica, view, list(view.shared))
        self._add(snapshot.replica, view, snapshot.hashes, tiers_of(snapshot))
        self._vouch(snapshot.replica, view, snapshot.shared)
        view.shared_capacity = snapshot.shared_capacity
        self._trim_shared()
        view.epoch, view.seq, view.stale = snapshot.epoch, snapshot.seq, False
        self.resyncs += 1

    def remove_replica(self, replica: str) -> None:
        view = self._replicas.pop(replica, None)
        if view is not None:
            self._drop(replica, view, list(view.hashes))
            self._unvouch(replica, view, list(view.shared))

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

    def _vouch(self, replica: str, view: ReplicaView, hashes: Iterable[int]) -> None:
        """``hashes`` were just used in the store, in this order: the most recent last."""
        shared = self._shared
        for h in hashes:
            view.shared.add(h)
            shared.setdefault(h, set()).add(replica)
            shared.move_to_end(h)

    def _trim_shared(self) -> None:
        """Forget the least recently used store pages beyond the store's budget (the largest
        any replica reports; none reported: unbounded)."""
        capacity = max((v.shared_capacity for v in self._replicas.values()), default=0)
        shared = self._shared
        if not capacity:
            return
        while len(shared) > capacity:
            h, owners = shared.popitem(last=False)
            for replica in owners:
                self._replicas[replica].shared.discard(h)

    def _unvouch(self, replica: str, view: ReplicaView, hashes: Iterable[int]) -> None:
        shared = self._shared
        for h in hashes:
            view.shared.discard(h)
            owners = shared.get(h)
            if owners is not None:
                owners.discard(replica)
                if not owners:
                    del shared[h]

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

    def shared_pages(self, hashes: Sequence[int]) -> int:
        """How many leading pages of the chain ``hashes`` the remote store holds (as far as
        the replicas know)."""
        n = 0
        shared = self._shared
        while n < len(hashes) and hashes[n] in shared:
            n += 1
        return n

    def prefix_tiers(
        self, hashes: Sequence[int], below: bool = True, replicas: Iterable[str] = ()
    ) -> dict[str, list[PageTier]]:
        """For each replica holding the first page: the places of its leading run of
        ``hashes``. ``below=False`` counts device pages only (the run ends at the first page
        not in the pool: what a router blind to the tiers sees). With ``below``, a page the
        remote store holds is held by every replica (the index's and ``replicas``) at
        ``PageTier.REMOTE`` where it holds none better, as its engine looks it up."""
        if below and (shared := self.shared_pages(hashes)):
            return {r: self._run_with_shared(r, hashes, shared)
                    for r in {*self._replicas, *replicas}}
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

    def _run_with_shared(
        self, replica: str, hashes: Sequence[int], shared: int
    ) -> list[PageTier]:
        """The replica's run over ``hashes`` whose first ``shared`` pages the remote store
        holds: each page at the replica's own place, else remote, up to the first missing."""
        view = self._replicas.get(replica)
        own, below = (view.hashes, view.below) if view is not None else (set(), {})
        run: list[PageTier] = []
        for i, h in enumerate(hashes):
            if h in own:
                run.append(below.get(h, PageTier.DEVICE))
            elif i < shared:
                run.append(PageTier.REMOTE)
            else:
                break
        return run

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

    @property
    def num_shared(self) -> int:
        """Distinct hashes some replica says are in the remote store."""
        return len(self._shared)

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
            assert PageTier.REMOTE not in view.below.values(), f"{replica}: remote as its own"
            for h in view.shared:
                assert replica in self._shared.get(h, ()), f"{replica} not vouching {h:#x}"
        vouches = sum(len(view.shared) for view in self._replicas.values())
        assert vouches == sum(len(owners) for owners in self._shared.values())
