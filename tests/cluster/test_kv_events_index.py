"""KV events from a real KVManager (and its host and disk tiers), batched by the publisher and
mirrored by the index (and the hub): the mirror always converges to exactly what the replica
holds and where (pool, host memory, disk), gaps included."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cluster import KVEventBatch, KVEventPublisher, KVIndex, KVSnapshot, PageTier
from cluster.events import kv_places
from cluster.hub import EventHub
from radix import KVManager, page_hashes
from radix.tiers import DiskStore, HostStore, KVTiers, PageRecord
from radix.tiers.disk import file_size

PAGE = 4
PAGE_DATA = 16


class BytesPool:
    """A pool's pages as bytes (the ``PageIO`` the tiers copy through)."""

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        return [self.data.get(page, bytes(PAGE_DATA)) for page in pages]

    def write_pages(self, pages: Sequence[int], data: Sequence[bytes]) -> None:
        self.data.update(zip(pages, data))


def tiered(
    directory: str | Path, pool_pages: int, host_pages: int, disk_pages: int, name: str = "r"
) -> KVManager:
    """A manager over host memory and disk stores of so many pages."""
    host = HostStore(host_pages * PAGE_DATA) if host_pages else None
    disk = None
    if disk_pages:
        sample = PageRecord(0, bytes(4 * PAGE), bytes(PAGE_DATA))
        disk = DiskStore(directory, disk_pages * file_size(sample), name)
    return KVManager(pool_pages, PAGE, tiers=KVTiers(BytesPool(), PAGE, host, disk))


def run_request(kv: KVManager, tokens: list[int], namespace: str | None = None) -> None:
    """As the scheduler runs one: the cached prefix, pages loaded from below, the rest."""
    handle = kv.acquire(tokens, namespace)
    kv.load(handle, tokens)
    assert kv.allocate(handle, len(tokens))
    kv.release(handle, tokens)


def tree_hashes(kv: KVManager) -> set[int]:
    return {page.key for page in kv.tree.walk_pages()}


def indexed(index: KVIndex, replica: str) -> dict[int, PageTier]:
    view = index.view(replica)
    assert view is not None
    return {h: view.where(h) for h in view.hashes}


def follow(index: KVIndex, publisher: KVEventPublisher) -> KVEventBatch | None:
    """Deliver the publisher's next batch (resyncing on a gap); the batch, if any."""
    batch = publisher.drain()
    if batch is not None and not index.apply(batch):
        index.resync(publisher.snapshot())
    return batch


def test_a_batch_nets_out_what_was_stored_and_evicted_in_between() -> None:
    kv = KVManager(num_pages=2, page_size=PAGE)
    publisher = KVEventPublisher("r0", epoch=7)
    publisher.attach(kv)
    run_request(kv, [1, 2, 3, 4, 5, 6, 7, 8])
    first = publisher.drain(load=3)
    assert first is not None and first.seq == 1 and first.epoch == 7 and first.load == 3
    assert set(first.stored) == set(page_hashes([1, 2, 3, 4, 5, 6, 7, 8], PAGE))
    assert publisher.drain() is None  # nothing changed since
    run_request(kv, [9, 9, 9, 9, 9])  # evicts one page, stores one
    run_request(kv, [8, 8, 8, 8, 8])  # evicts that new page again: it nets out
    second = publisher.drain()
    assert second is not None and second.seq == 2
    assert set(second.stored) == tree_hashes(kv) - set(first.stored)
    assert page_hashes([9, 9, 9, 9], PAGE)[0] not in second.stored + second.removed
    assert set(second.removed) == set(first.stored) - tree_hashes(kv)


def test_the_same_tokens_in_two_namespaces_are_two_addresses() -> None:
    kv = KVManager(num_pages=8, page_size=PAGE)
    publisher = KVEventPublisher("r0")
    publisher.attach(kv)
    run_request(kv, [1, 2, 3, 4, 5], "tenant-a")
    run_request(kv, [1, 2, 3, 4, 5], "tenant-b")
    batch = publisher.drain()
    assert batch is not None and len(set(batch.stored)) == 2
    index = KVIndex()
    index.resync(KVSnapshot("r0", publisher.epoch, 0, []))
    assert index.apply(batch)
    assert index.prefix_pages(page_hashes([1, 2, 3, 4], PAGE, "tenant-a")) == {"r0": 1}
    assert index.prefix_pages(page_hashes([1, 2, 3, 4], PAGE, "tenant-c")) == {}


def test_a_gap_makes_the_replica_stale_until_a_snapshot_resyncs_it() -> None:
    index = KVIndex()
    index.resync(KVSnapshot("r0", 1, 0, []))
    assert index.apply(KVEventBatch("r0", 1, 1, [10, 11], []))
    assert not index.apply(KVEventBatch("r0", 1, 3, [12], [10]))  # batch 2 went missing
    assert index.stale() == ["r0"] and index.gaps == 1
    assert not index.apply(KVEventBatch("r0", 1, 4, [13], []))  # still stale
    index.resync(KVSnapshot("r0", 1, 4, [11, 12, 13]))
    assert index.view("r0").hashes == {11, 12, 13} and not index.stale()
    assert index.apply(KVEventBatch("r0", 1, 4, [99], []))  # a duplicate: ignored
    assert 99 not in index.view("r0").hashes
    assert not index.apply(KVEventBatch("r0", 2, 1, [], []))  # restarted: new epoch
    index.check()


def test_prefix_pages_counts_only_the_leading_run_each_replica_holds() -> None:
    index = KVIndex()
    index.resync(KVSnapshot("a", 1, 0, [1, 2, 3]))
    index.resync(KVSnapshot("b", 1, 0, [1, 3, 4]))
    assert index.prefix_pages([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert index.prefix_pages([5, 1]) == {}
    index.remove_replica("a")
    assert index.prefix_pages([1, 2]) == {"b": 1}
    assert index.num_hashes == 3
    index.check()


def test_the_hub_serves_batches_past_a_cursor_or_a_snapshot_when_too_far_behind() -> None:
    hub = EventHub(keep=2)
    assert not hub.publish(KVEventBatch("r0", 5, 1, [1], []))  # never snapshotted
    hub.publish_snapshot(KVSnapshot("r0", 5, 1, [1]))
    for seq in (2, 3, 4):
        assert hub.publish(KVEventBatch("r0", 5, seq, [seq * 10], [], load=seq))
    pulled = hub.pull({"r0": (5, 2)})
    assert [u.seq for u in pulled.updates] == [3, 4] and pulled.loads == {"r0": 4}
    [snapshot] = hub.pull({"r0": (5, 1)}).updates  # batch 2 is no longer kept
    assert isinstance(snapshot, KVSnapshot) and set(snapshot.hashes) == {1, 20, 30, 40}
    assert hub.pull({"r0": (5, 4)}).updates == []
    assert not hub.publish(KVEventBatch("r0", 5, 6, [60], []))  # the hub missed batch 5
    assert hub.pull({}).updates == []  # stale at the hub: nothing to offer until resynced
    hub.forget("r0")
    assert hub.pull({}).loads == {} and hub.num_hashes() == 0


def test_a_replica_that_stops_reporting_leaves_the_stats_and_the_mirror() -> None:
    """Serve replaces a killed replica without its ``forget``: once silent past the limit,
    its last stats (pages, running requests) stop counting and its hashes leave the routers."""
    now = [0.0]
    hub = EventHub(silent_s=10.0, clock=lambda: now[0])
    for replica, hashes in (("live", [1, 2]), ("killed", [3, 4])):
        hub.publish_snapshot(KVSnapshot(replica, 1, 0, hashes))
        hub.publish_stats(replica, {"pages_total": 512, "requests_running": 5})
    for _ in range(30):  # 15 s of reports every 0.5 s, from the live replica only
        now[0] += 0.5
        hub.publish_stats("live", {"pages_total": 512, "requests_running": 0})
        assert "live" in hub.stats()
    assert list(hub.stats()) == ["live"]
    assert set(hub.pull({}).loads) == {"live"} and hub.num_hashes() == 2


def test_a_page_moves_down_the_tiers_back_to_the_device_and_is_removed_off_the_last(
    tmp_path: Path,
) -> None:
    kv = tiered(tmp_path, pool_pages=3, host_pages=1, disk_pages=1)
    publisher = KVEventPublisher("r0", epoch=1)
    publisher.attach(kv)
    index = KVIndex()
    index.resync(publisher.snapshot())
    first, second = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], PAGE)
    run_request(kv, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    batch = follow(index, publisher)
    assert batch is not None and {first, second} <= set(batch.stored)
    assert batch.host == batch.disk == [] and batch.removed == []
    assert indexed(index, "r0")[first] is PageTier.DEVICE

    run_request(kv, [9, 9, 9, 9, 8, 8, 8, 8, 0])  # both evicted: one to host, one to disk
    batch = follow(index, publisher)
    assert batch is not None and batch.removed == []  # moved, not evicted
    assert {first, second} == set(batch.host) | set(batch.disk)
    assert {index.view("r0").where(h) for h in (first, second)} == {
        PageTier.HOST,
        PageTier.DISK,
    }
    assert index.prefix_pages([first, second]) == {"r0": 2}
    assert index.prefix_tiers([first, second], below=False) == {}  # the pool has neither

    kv.tiers.flush()
    run_request(kv, [1, 2, 3, 4, 5, 6, 7, 8, 0])  # loaded back into the pool
    batch = follow(index, publisher)
    assert batch is not None and {first, second} <= set(batch.stored)
    assert not {first, second} & set(batch.host + batch.disk)
    assert index.prefix_tiers([first, second]) == {"r0": [PageTier.DEVICE] * 2}

    for stem in (5, 6, 7):  # others push them down and then off the last tier
        run_request(kv, [stem] * 8 + [0])
        follow(index, publisher)
    assert first not in kv_places(kv) and first not in index.view("r0").hashes
    assert indexed(index, "r0") == kv_places(kv)
    index.check()
    kv.tiers.close()


def test_down_and_back_up_between_two_drains_is_no_change(tmp_path: Path) -> None:
    kv = tiered(tmp_path, pool_pages=2, host_pages=4, disk_pages=0)
    publisher = KVEventPublisher("r0")
    publisher.attach(kv)
    run_request(kv, [1, 2, 3, 4, 0])
    publisher.drain()
    run_request(kv, [9, 9, 9, 9, 0])  # (1,2,3,4) to host memory
    run_request(kv, [1, 2, 3, 4, 0])  # and back
    batch = publisher.drain()
    assert batch is not None
    moved = page_hashes([1, 2, 3, 4], PAGE)[0]
    assert moved not in batch.stored + batch.removed + batch.host
    assert publisher.where(moved) is PageTier.DEVICE


def test_the_index_counts_each_replicas_pages_by_place() -> None:
    index = KVIndex()
    index.resync(KVSnapshot("a", 1, 0, [1, 2, 3, 4, 5], host=[3, 4], disk=[5]))
    index.resync(KVSnapshot("b", 1, 0, [1, 9]))
    counts = index.view("a").tier_counts()
    assert counts == {PageTier.DEVICE: 2, PageTier.HOST: 2, PageTier.DISK: 1}
    assert index.held("a") == 2  # pool pages: the tie-break among equal matches
    assert index.apply(KVEventBatch("a", 1, 1, stored=[3, 6], removed=[5], disk=[6]))
    counts = index.view("a").tier_counts()
    assert counts == {PageTier.DEVICE: 3, PageTier.HOST: 1, PageTier.DISK: 1}
    assert index.view("b").tier_counts()[PageTier.DEVICE] == 2
    assert index.prefix_tiers([1, 2, 4]) == {
        "a": [PageTier.DEVICE, PageTier.DEVICE, PageTier.HOST],
        "b": [PageTier.DEVICE],
    }
    index.check()


class BatchV1(msgspec.Struct, frozen=True):
    """The batch as schema 1 had it (no places): an old consumer."""

    replica: str
    epoch: int
    seq: int
    stored: list[int]
    removed: list[int]
    load: int = 0


def test_old_consumers_see_pages_below_as_held_and_old_batches_read_as_pool_pages() -> None:
    new = KVEventBatch("r0", 1, 1, stored=[1, 2, 3], removed=[4], host=[2], disk=[3])
    old = msgspec.json.decode(msgspec.json.encode(new), type=BatchV1)
    assert old.stored == [1, 2, 3] and old.removed == [4]  # held, wherever they are
    back = msgspec.json.decode(msgspec.json.encode(old), type=KVEventBatch)
    index = KVIndex()
    index.resync(KVSnapshot("r0", 1, 0, [4]))
    assert index.apply(back)
    assert indexed(index, "r0") == dict.fromkeys([1, 2, 3], PageTier.DEVICE)


def test_the_hub_gives_a_router_that_fell_behind_the_places_in_its_snapshot() -> None:
    hub = EventHub(keep=1)
    hub.publish_snapshot(KVSnapshot("r0", 5, 0, [1, 2], host=[2]))
    assert hub.publish(KVEventBatch("r0", 5, 1, [3], [], disk=[3]))
    assert hub.publish(KVEventBatch("r0", 5, 2, [1], [2], host=[1]))
    [snapshot] = hub.pull({"r0": (5, 0)}).updates
    assert isinstance(snapshot, KVSnapshot)
    assert (sorted(snapshot.hashes), snapshot.host, snapshot.disk) == ([1, 3], [1], [3])
    router = KVIndex()
    router.resync(snapshot)
    assert indexed(router, "r0") == {1: PageTier.HOST, 3: PageTier.DISK}


class PublishedIndexMachine(RuleBasedStateMachine):
    """Requests run on two replicas, one of them over host memory and disk; batches travel
    to a router that may lose some. Whenever the router has caught up (resyncing where it
    must), its index holds exactly what each replica holds, each page at its place."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory()
        self.kvs = {
            "a": tiered(self._dir.name, pool_pages=10, host_pages=3, disk_pages=4),
            "b": KVManager(num_pages=10, page_size=PAGE),
        }
        self.publishers = {name: KVEventPublisher(name) for name in self.kvs}
        for name, kv in self.kvs.items():
            self.publishers[name].attach(kv)
        self.index = KVIndex()
        self.max_hashes = 0

    @rule(
        replica=st.sampled_from(["a", "b"]),
        stem=st.integers(0, 3),
        length=st.integers(1, 14),
        namespace=st.sampled_from([None, "t"]),
    )
    def request(self, replica: str, stem: int, length: int, namespace: str | None) -> None:
        rng = random.Random(stem)
        tokens = [rng.randrange(1, 6) for _ in range(length)]
        run_request(self.kvs[replica], tokens, namespace)

    @rule(replica=st.sampled_from(["a", "b"]), lose=st.booleans())
    def deliver(self, replica: str, lose: bool) -> None:
        batch = self.publishers[replica].drain()
        if batch is None or lose:
            return
        if not self.index.apply(batch):
            self.index.resync(self.publishers[replica].snapshot())

    @rule()
    def flush_disk(self) -> None:
        tiers = self.kvs["a"].tiers
        assert tiers is not None
        tiers.flush()

    @invariant()
    def index_is_consistent_and_bounded(self) -> None:
        self.index.check()
        self.max_hashes = max(self.max_hashes, self.index.num_hashes)
        assert self.index.num_hashes <= sum(kv.num_pages for kv in self.kvs.values()) + 3 + 4

    @invariant()
    def the_publisher_knows_where_every_page_is_now(self) -> None:
        for name, kv in self.kvs.items():
            truth = kv_places(kv)
            publisher = self.publishers[name]
            assert publisher.num_hashes == len(truth)
            assert all(publisher.where(h) is tier for h, tier in truth.items()), name

    def teardown(self) -> None:
        for name, publisher in self.publishers.items():
            batch = publisher.drain()
            applied = batch is not None and self.index.apply(batch)
            view = self.index.view(name)
            if not applied and (view is None or view.stale or view.seq != publisher.seq):
                self.index.resync(publisher.snapshot())  # a lost last batch shows as a seq lag
            assert indexed(self.index, name) == kv_places(self.kvs[name]), name
        tiers = self.kvs["a"].tiers
        assert tiers is not None
        tiers.close()
        self._dir.cleanup()


TestPublishedIndexMachine = PublishedIndexMachine.TestCase
TestPublishedIndexMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
