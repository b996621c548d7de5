"""KV tiers under the tree: every page in one place, nothing lost, loads bit-exact (a
hypothesis state machine over KVManager + host + disk), the events that tell a listener
where every page is, and the disk format's promises (a damaged, truncated or foreign file is
a miss; a restarted store finds its files)."""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path
from typing import NamedTuple

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radix import KVEvent, KVManager, PagesEvicted, PagesStored, page_hashes
from radix.tiers import DiskStore, HostStore, KVTiers, LoadCost, PageRecord, Tier, TierChanged
from radix.tiers.disk import encode_record, file_size

PAGE = 2
PAGE_DATA = 32  # bytes of "KV" per page in the fake pool


def kv_of(key: int) -> bytes:
    """The KV a page would hold: a function of its content address only (as the model's is
    a function of the prefix and namespace), so any misplaced page shows."""
    return struct.pack("<Q", key) * (PAGE_DATA // 8)


class FakePool:
    """The pool's bytes, page by page (radix never sees tensors: this is all it needs)."""

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}
        self.reads = 0

    def read_pages(self, pages: list[int]) -> list[bytes]:
        self.reads += len(pages)
        return [self.data[page] for page in pages]

    def write_pages(self, pages: list[int], data: list[bytes]) -> None:
        for page, blob in zip(pages, data):
            self.data[page] = blob


def serve(kv: KVManager, pool: FakePool, tokens: list[int], namespace: str | None = None):
    """One request the way the scheduler runs it: acquire, load from below, compute the rest
    (the fake model writes each new page's KV), cache everything, release."""
    cap = ((len(tokens) - 1) // PAGE) * PAGE
    handle = kv.acquire(tokens[:cap], namespace)
    pool_hit = handle.cached_len
    loaded = kv.load(handle, tokens[:cap])
    # Loaded pages hold exactly the KV their content address names.
    chain = page_hashes(tokens, PAGE, namespace)
    for i in range(pool_hit // PAGE, handle.cached_len // PAGE):
        assert pool.data[handle.pages[i]] == kv_of(chain[i]), "a loaded page holds other KV"
    assert kv.allocate(handle, len(tokens))
    for i in range(handle.cached_len // PAGE, len(tokens) // PAGE):
        pool.data[handle.pages[i]] = kv_of(chain[i])
    kv.release(handle, tokens)
    return pool_hit, loaded


class Below(NamedTuple):
    """Where a prompt's cached prefix lives, in tokens: the pool, then below it."""

    pool: int
    host: int
    disk: int

    @property
    def total(self) -> int:
        return self.pool + self.host + self.disk


def where_cached(kv: KVManager, tokens: list[int], namespace: str | None = None) -> Below:
    """Read-only, by content address (nothing matched, locked or touched): how many leading
    whole-page tokens of ``tokens`` the pool holds, then how many follow them in host memory
    and on disk, in prompt order (what ``acquire`` + ``load`` should bring)."""
    tiers = kv.tiers
    assert tiers is not None
    in_pool = {page.key for page in kv.tree.walk_pages()}
    chain = page_hashes(tokens, PAGE, namespace)
    pool = 0
    while pool < len(chain) and chain[pool] in in_pool:
        pool += 1
    below = [tiers.where(key) for key in chain[pool:]]
    found = below[: below.index(None)] if None in below else below
    host = sum(1 for tier in found if tier is Tier.HOST)
    return Below(pool * PAGE, host * PAGE, (len(found) - host) * PAGE)


class Places:
    """A listener that knows, from the manager's events alone, which pages the pool, host
    memory and disk each hold."""

    def __init__(self) -> None:
        self.pool: set[int] = set()
        self.below: dict[Tier, set[int]] = {Tier.HOST: set(), Tier.DISK: set()}

    def __call__(self, event: KVEvent) -> None:
        if isinstance(event, PagesStored):
            self.pool.update(event.hashes)
        elif isinstance(event, PagesEvicted):
            self.pool.difference_update(event.hashes)
        elif isinstance(event, TierChanged):
            held = self.below[event.tier]
            held.difference_update(event.removed)
            held.update(event.added)

    def check(self, kv: KVManager) -> None:
        """The events told exactly what each place holds."""
        tiers = kv.tiers
        assert tiers is not None
        assert self.pool == {page.key for page in kv.tree.walk_pages()}, "pool"
        for tier, store in ((Tier.HOST, tiers.host), (Tier.DISK, tiers.disk)):
            assert self.below[tier] == set(store.keys() if store else ()), tier.value


def make(tmp: str, pool_pages: int, host_pages: int, disk_pages: int | None):
    pool = FakePool()
    host = HostStore(host_pages * PAGE_DATA) if host_pages else None
    disk = None
    if disk_pages is not None:
        record = PageRecord(0, b"\0" * 4 * PAGE, b"\0" * PAGE_DATA)
        disk = DiskStore(tmp, disk_pages * file_size(record), "model-a")
    tiers = KVTiers(pool, PAGE, host, disk)
    return KVManager(pool_pages, PAGE, tiers=tiers), pool, tiers


# ---------------------------------------------------------------------- examples


def test_an_evicted_page_comes_back_from_host_memory_bit_for_bit(tmp_path: Path) -> None:
    kv, pool, tiers = make(str(tmp_path), pool_pages=3, host_pages=8, disk_pages=None)
    serve(kv, pool, [1, 2, 3, 4, 5])  # pages (1,2), (3,4) cached
    serve(kv, pool, [9, 9, 8, 8, 7])  # evicts both: written to host
    assert tiers.stats().written_host == 2
    assert where_cached(kv, [1, 2, 3, 4, 5]).host == 4
    pool_hit, loaded = serve(kv, pool, [1, 2, 3, 4, 5])
    assert (pool_hit, loaded.host, loaded.disk) == (0, 4, 0)
    kv.check([])


def test_a_page_already_below_is_not_copied_again(tmp_path: Path) -> None:
    kv, pool, tiers = make(str(tmp_path), pool_pages=3, host_pages=8, disk_pages=None)
    serve(kv, pool, [1, 2, 3, 4, 5])
    serve(kv, pool, [9, 9, 8, 8, 7])
    serve(kv, pool, [1, 2, 3, 4, 5])  # loaded back (and still below)
    reads = pool.reads
    serve(kv, pool, [9, 9, 8, 8, 7])  # evicts (1,2),(3,4) again; (9,9),(8,8) loaded
    assert pool.reads == reads, "write-back copied pages that were already below"
    assert tiers.stats().written_host == 4


def test_host_overflow_goes_to_disk_and_comes_back(tmp_path: Path) -> None:
    kv, pool, tiers = make(str(tmp_path), pool_pages=3, host_pages=2, disk_pages=16)
    serve(kv, pool, [1, 2, 3, 4, 5])
    serve(kv, pool, [9, 9, 8, 8, 7])
    serve(kv, pool, [6, 6, 5, 5, 4])  # host full: (1,2),(3,4) move to disk
    assert where_cached(kv, [1, 2, 3, 4, 5]).disk == 4
    tiers.flush()
    _, loaded = serve(kv, pool, [1, 2, 3, 4, 5])
    assert loaded.disk == 4
    kv.check([])


def test_namespaces_never_share_pages_below_the_pool(tmp_path: Path) -> None:
    kv, pool, _ = make(str(tmp_path), pool_pages=3, host_pages=8, disk_pages=8)
    serve(kv, pool, [1, 2, 3, 4, 5], namespace="alice")
    serve(kv, pool, [9, 9, 8, 8, 7], namespace="alice")
    assert where_cached(kv, [1, 2, 3, 4, 5], "alice").total == 4
    assert where_cached(kv, [1, 2, 3, 4, 5], "bob").total == 0
    assert where_cached(kv, [1, 2, 3, 4, 5]).total == 0
    _, loaded = serve(kv, pool, [1, 2, 3, 4, 5], namespace="bob")
    assert loaded.total == 0


def test_a_tier_slower_than_recomputing_is_not_loaded_from() -> None:
    cost = LoadCost(page_size=16)
    assert cost.pays(Tier.DISK)  # nothing measured: assume it pays
    cost.observe_compute(tokens=1000, seconds=1.0)  # 16 ms per page
    cost.observe_load(Tier.DISK, pages=1, seconds=0.050)
    cost.observe_load(Tier.HOST, pages=1, seconds=0.0001)
    assert cost.pays(Tier.HOST) and not cost.pays(Tier.DISK)
    tries = [cost.pays(Tier.DISK) for _ in range(200)]
    assert 1 <= sum(tries) <= 4, "a slow tier must still be retried now and then"


def test_close_writes_the_pool_down_and_a_new_store_finds_it(tmp_path: Path) -> None:
    kv, pool, tiers = make(str(tmp_path), pool_pages=8, host_pages=0, disk_pages=16)
    serve(kv, pool, [1, 2, 3, 4, 5, 6, 7])
    kv.close()
    kv2, pool2, _ = make(str(tmp_path), pool_pages=8, host_pages=0, disk_pages=16)
    assert where_cached(kv2, [1, 2, 3, 4, 5, 6, 7]).disk == 6
    _, loaded = serve(kv2, pool2, [1, 2, 3, 4, 5, 6, 7])
    assert loaded.disk == 6
    # Another store key (another model, dtype or page size) sees nothing of it.
    other = DiskStore(tmp_path, 1 << 20, "model-b")
    assert len(other) == 0


def test_the_events_follow_a_page_down_to_disk_back_up_and_off_the_last_tier(
    tmp_path: Path,
) -> None:
    kv, pool, tiers = make(str(tmp_path), pool_pages=3, host_pages=1, disk_pages=1)
    places = Places()
    kv.subscribe(places)
    first, second = page_hashes([1, 2, 3, 4], PAGE)
    serve(kv, pool, [1, 2, 3, 4, 5])
    assert places.pool >= {first, second}
    serve(kv, pool, [9, 9, 8, 8, 7])  # evicted: (3,4) then (1,2) written down
    assert {first, second}.isdisjoint(places.pool)
    assert places.below[Tier.HOST] | places.below[Tier.DISK] == {first, second}
    places.check(kv)
    tiers.flush()
    serve(kv, pool, [1, 2, 3, 4, 5])  # loaded back: in the pool, and still below
    assert {first, second} <= places.pool
    places.check(kv)
    for stem in ([6, 6, 5, 5, 4], [7, 7, 6, 6, 5], [8, 8, 7, 7, 6]):
        serve(kv, pool, stem)  # one host page, one disk page: the old ones fall off
    assert first not in places.pool | places.below[Tier.HOST] | places.below[Tier.DISK]
    assert tiers.stats().dropped > 0
    places.check(kv)


def test_a_new_listener_first_hears_what_the_tiers_hold_already(tmp_path: Path) -> None:
    kv, pool, _ = make(str(tmp_path), pool_pages=8, host_pages=0, disk_pages=16)
    serve(kv, pool, [1, 2, 3, 4, 5, 6, 7])
    kv.close()
    kv2, _, _ = make(str(tmp_path), pool_pages=8, host_pages=0, disk_pages=16)
    places = Places()
    kv2.subscribe(places)  # a restarted engine: its disk is warm before anything runs
    assert places.below[Tier.DISK] == set(page_hashes([1, 2, 3, 4, 5, 6], PAGE))
    places.check(kv2)


def test_a_failed_disk_write_leaves_the_listeners_view_too(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20, "m")
    seen: list[tuple[list[int], list[int]]] = []
    store.watch(lambda added, removed: seen.append((list(added), list(removed))))
    record = PageRecord(1, b"\0" * 8, b"x" * 64)
    path = store.path(record.key)
    path.parent.mkdir(exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{store._writer.ident}.tmp"
    tmp.symlink_to("/dev/full")
    assert store.put(record)
    store.flush()
    assert store.keys() == []
    assert seen == [([1], []), ([], [1])]
    store.close()


# ---------------------------------------------------------------------- the disk format


def _stored(tmp_path: Path) -> tuple[DiskStore, PageRecord]:
    store = DiskStore(tmp_path, 1 << 20, "m")
    record = PageRecord(0x1234_5678_9ABC_DEF0, b"\1\0\0\0\2\0\0\0", b"kv-bytes" * 10)
    assert store.put(record)
    store.flush()
    return store, record


def test_a_record_written_to_disk_reads_back_equal(tmp_path: Path) -> None:
    store, record = _stored(tmp_path)
    assert store.path(record.key).read_bytes() == encode_record(record)
    assert store.get(record.key, record.tokens) == record
    assert store.get(record.key, b"\x09\0\0\0\2\0\0\0") is None  # other tokens: a miss
    store.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[: len(raw) // 2],  # truncated
        lambda raw: raw[:-1],  # one byte short
        lambda raw: raw[:40] + bytes([raw[40] ^ 1]) + raw[41:],  # a flipped bit in the KV
        lambda raw: b"",  # empty
        lambda raw: b"NOTAPAGE" + raw[8:],  # foreign magic
    ],
    ids=["truncated", "one-byte-short", "flipped-bit", "empty", "foreign"],
)
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path: Path, damage) -> None:
    store, record = _stored(tmp_path)
    store.close()
    path = store.path(record.key)
    path.write_bytes(damage(path.read_bytes()))
    again = DiskStore(tmp_path, 1 << 20, "m")
    assert record.key in again  # indexed by name...
    assert again.get(record.key, record.tokens) is None  # ...but never returned
    assert again.corrupt == 1 and record.key not in again
    again.flush()
    assert not path.exists()
    again.close()


def test_a_file_under_another_keys_name_is_a_miss(tmp_path: Path) -> None:
    store, record = _stored(tmp_path)
    store.close()
    other = 0x0FED_CBA9_8765_4321
    target = store.path(other)  # the same layout: a closed store still names paths
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(store.path(record.key).read_bytes())
    again = DiskStore(tmp_path, 1 << 20, "m")
    assert again.get(other, record.tokens) is None and again.corrupt == 1
    again.close()


def test_a_half_written_temporary_file_is_cleared_at_open(tmp_path: Path) -> None:
    store, record = _stored(tmp_path)
    store.close()
    tmp = store.path(record.key).parent / f".{record.key:016x}.kv.99.1.tmp"
    tmp.write_bytes(encode_record(record)[:10])
    again = DiskStore(tmp_path, 1 << 20, "m")
    assert not tmp.exists() and len(again) == 1
    again.close()


def test_the_disk_budget_deletes_least_recently_used_files(tmp_path: Path) -> None:
    records = [PageRecord(k, b"\0" * 8, bytes([k]) * 64) for k in range(1, 6)]
    size = file_size(records[0])
    store = DiskStore(tmp_path, 3 * size, "m")
    for record in records[:3]:
        store.put(record)
    store.touch(1)
    store.put(records[3])  # evicts key 2, the least recently used
    store.put(records[4])  # evicts key 3
    store.flush()
    assert sorted(store.keys()) == [1, 4, 5]
    assert sorted(p.name for p in store.directory.rglob("*.kv")) == [
        f"{k:016x}.kv" for k in (1, 4, 5)
    ]
    store.check()
    store.close()
    # A smaller budget at the next open deletes the oldest files down to it.
    again = DiskStore(tmp_path, 2 * size, "m")
    assert len(again) == 2 and again.used_bytes <= 2 * size
    again.close()


def _modes(top: Path) -> dict[str, int]:
    """Every directory and file under ``top`` (itself included) -> its permission bits."""
    modes = {".": top.stat().st_mode & 0o777}
    for path in top.rglob("*"):
        modes[str(path.relative_to(top))] = path.lstat().st_mode & 0o777
    return modes


def test_every_file_and_directory_the_store_writes_is_private_whatever_the_umask(
    tmp_path: Path,
) -> None:
    """Files hold tenants' token ids and the manifest names the model: 0600 files in 0700
    directories, under a permissive umask too, from the directories the store creates down
    to the lock, the manifest and a temporary file caught mid-write."""
    old = os.umask(0o002)
    try:
        target = tmp_path / "kv" / "deeper"  # created by the store
        store = DiskStore(target, 1 << 20, "m")
        store.write_manifest('{"model": "m"}\n')
        for key in (1, 2 << 56, 3 << 56):
            assert store.put(PageRecord(key, b"\1\0\0\0", b"kv" * 8))
        store.flush()
        seen_tmp: list[int] = []
        original = os.replace

        def replace(src, dst):  # look at the temporary file just before it is renamed
            seen_tmp.append(os.stat(src).st_mode & 0o777)
            return original(src, dst)

        os.replace = replace
        try:
            assert store.put(PageRecord(4 << 56, b"\1\0\0\0", b"kv" * 8))
            store.flush()
        finally:
            os.replace = original
        store.close()
    finally:
        os.umask(old)
    assert seen_tmp == [0o600]
    modes = _modes(tmp_path / "kv")
    assert {"deeper/m/store.json", "deeper/m/.lock", "deeper/m/04"} <= set(modes)
    assert len([name for name in modes if name.endswith(".kv")]) == 4
    wrong = {
        name: oct(mode) for name, mode in modes.items()
        if mode != (0o700 if (tmp_path / "kv" / name).is_dir() else 0o600)
    }
    assert wrong == {}


def test_a_store_made_private_again_when_an_older_version_left_it_readable(
    tmp_path: Path,
) -> None:
    """store.json was 0644 (and a umask could widen directories): reopening fixes them."""
    store, _ = _stored(tmp_path)
    store.write_manifest("{}\n")
    store.close()
    for path in [store.directory, *store.directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    DiskStore(tmp_path, 1 << 20, "m").close()
    modes = _modes(store.directory)
    assert set(modes.values()) == {0o700, 0o600}, modes
    assert modes["store.json"] == 0o600 and modes["."] == 0o700


def test_a_second_store_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    store, _ = _stored(tmp_path)
    with pytest.raises(ValueError, match="kv_disk_dir: .* in use by another engine"):
        DiskStore(tmp_path, 1 << 20, "m")
    store.close()
    DiskStore(tmp_path, 1 << 20, "m").close()  # free again once the first closed


def test_an_unusable_directory_is_a_value_error_naming_the_field(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="kv_disk_dir: cannot use"):
        DiskStore(a_file / "below", 1 << 20, "m")


def test_failed_writes_leave_no_files_are_counted_and_unindexed(tmp_path: Path) -> None:
    """A full disk, for real: each page's temporary file is made a link to /dev/full, whose
    writes the kernel fails with ENOSPC. Nothing is left behind, every failure is counted,
    and the store stops claiming the pages (so nothing is read back from a missing file)."""
    store = DiskStore(tmp_path, 1 << 20, "m")
    records = [PageRecord(k, b"\0" * 8, bytes([k]) * 64) for k in range(1, 4)]
    writer = store._writer.ident
    for r in records[:2]:
        path = store.path(r.key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{writer}.tmp"
        tmp.symlink_to("/dev/full")
    for r in records:
        assert store.put(r)
    store.flush()
    assert store.write_errors == 2
    assert sorted(store.keys()) == [3] and store.used_bytes == file_size(records[2])
    assert [p.name for p in store.directory.rglob("*.kv")] == [f"{3:016x}.kv"]
    assert not list(store.directory.rglob("*.tmp"))
    assert store.get(1, records[0].tokens) is None
    store.check()
    store.close()


# ---------------------------------------------------------------------- state machine

STEMS = [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8], [9, 9, 9, 9, 9, 9, 9, 9], [3, 3, 1, 2]]


class TieredKV(RuleBasedStateMachine):
    """Requests served through a tiny pool over a tiny host store and disk store: after every
    step each tier keeps its budget and counts, host and disk hold disjoint pages, every page
    anywhere holds exactly the KV of its content address (nothing misplaced, nothing torn),
    and whatever was evicted is found below unless a budget dropped it."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory()
        self.kv, self.pool, self.tiers = make(
            self._dir.name, pool_pages=7, host_pages=3, disk_pages=4
        )
        self.places = Places()
        self.kv.subscribe(self.places)
        self.served = 0

    def teardown(self) -> None:
        self.tiers.close()
        self._dir.cleanup()

    @rule(
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(0, 3), max_size=4),
        namespace=st.sampled_from([None, "t1"]),
    )
    def serve_request(self, stem: list[int], tail: list[int], namespace: str | None) -> None:
        tokens = stem + tail + [0]
        before = where_cached(self.kv, tokens, namespace)
        pool_hit, loaded = serve(self.kv, self.pool, tokens, namespace)
        cap = ((len(tokens) - 1) // PAGE) * PAGE
        assert pool_hit == min(before.pool, cap)
        # What was found below by content address is what load brought (nothing raced it here).
        assert loaded.total == min(before.total, cap) - pool_hit
        self.served += 1

    @precondition(lambda self: self.served > 0)
    @rule()
    def flush_disk(self) -> None:
        self.tiers.flush()

    @invariant()
    def every_page_is_in_one_place_and_holds_its_own_kv(self) -> None:
        self.kv.check([])
        host, disk = self.tiers.host, self.tiers.disk
        assert host is not None and disk is not None
        for key in host.keys():
            record = host.get(key)
            assert record is not None and record.data == kv_of(key)
        for page in self.kv.tree.walk_pages():
            assert self.pool.data[page.page] == kv_of(page.key)
        stats = self.tiers.stats()
        assert stats.written_host + stats.written_disk >= stats.host_pages + stats.disk_pages
        self.places.check(self.kv)  # a listener knows where every page is


def test_disk_records_hold_their_own_kv_after_the_machine_runs(tmp_path: Path) -> None:
    kv, pool, tiers = make(str(tmp_path), pool_pages=5, host_pages=1, disk_pages=8)
    for stem in STEMS * 2:
        serve(kv, pool, stem + [0])
    tiers.flush()
    disk = tiers.disk
    assert disk is not None and len(disk) > 0
    for key in disk.keys():
        raw = disk.path(key).read_bytes()
        assert kv_of(key) in raw


TieredKV.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestTieredKV = TieredKV.TestCase
