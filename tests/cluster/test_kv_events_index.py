"""KV events from a real KVManager, batched by the publisher and mirrored by the index (and
the hub): the mirror always converges to exactly what the tree holds, gaps included."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cluster import KVEventBatch, KVEventPublisher, KVIndex, KVSnapshot
from cluster.hub import EventHub
from radix import KVManager, page_hashes

PAGE = 4


def run_request(kv: KVManager, tokens: list[int], namespace: str | None = None) -> None:
    handle = kv.acquire(tokens, namespace)
    assert kv.allocate(handle, len(tokens))
    kv.release(handle, tokens)


def tree_hashes(kv: KVManager) -> set[int]:
    return {page.key for page in kv.tree.walk_pages()}


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


class PublishedIndexMachine(RuleBasedStateMachine):
    """Requests run on two replicas; batches travel to a router that may lose some. Whenever
    the router has caught up (resyncing where it must), its index equals the trees."""

    def __init__(self) -> None:
        super().__init__()
        self.kvs = {name: KVManager(num_pages=10, page_size=PAGE) for name in ("a", "b")}
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

    @invariant()
    def index_is_consistent_and_bounded(self) -> None:
        self.index.check()
        self.max_hashes = max(self.max_hashes, self.index.num_hashes)
        assert self.index.num_hashes <= sum(kv.num_pages for kv in self.kvs.values())

    def teardown(self) -> None:
        for name, publisher in self.publishers.items():
            batch = publisher.drain()
            applied = batch is not None and self.index.apply(batch)
            view = self.index.view(name)
            if not applied and (view is None or view.stale or view.seq != publisher.seq):
                self.index.resync(publisher.snapshot())  # a lost last batch shows as a seq lag
            assert self.index.view(name).hashes == tree_hashes(self.kvs[name]), name


TestPublishedIndexMachine = PublishedIndexMachine.TestCase
TestPublishedIndexMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
