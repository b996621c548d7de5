"""KVTiers: the pages below the KV pool, in a host store and on disk, by content address.

The tree maps prefixes onto pool pages; below it, pages are found by the xxhash chain the
tree's nodes already carry, continued over a prompt's tokens past the tree's match. So a page
evicted from the pool is written down (once: a page already below is only refreshed), found
again by the next prompt that holds its prefix, and loaded back into a fresh pool page.

- host and disk hold disjoint keys: the host store's least recently used records move to disk
  (or are dropped without one); the disk deletes by its own LRU within its budget.
- a load keeps the page below too (inclusive), so evicting it again copies nothing.
- the engine moves the bytes (``PageIO``: read pool pages, write pool pages); nothing here
  knows tensors.
- every change of a store's keys is a ``TierChanged`` to the subscribers (``subscribe``): a
  router told where each page is sends a returning prompt to the replica that can load it.
- a remote store (``RemoteStore``: Redis), shared by every engine of the model, sits below
  both: each page the tree gains is copied there (``share``, written by its own thread), so
  another replica or machine finds it; it is asked after host and disk miss, in one round trip
  for the rest of a prompt, and read in one. The keys this engine knows to be there (written
  or read by it; a key found missing is forgotten: the store evicts by its own policy) are
  announced as ``TierChanged(Tier.REMOTE, ...)``, so a router counts them held by every
  replica of the store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from radix.hashing import chain_hashes
from radix.tiers.changes import TierChanged
from radix.tiers.cost import LoadCost
from radix.tiers.disk import DiskStore
from radix.tiers.host import HostStore
from radix.tiers.record import EvictedPage, FetchedPage, PageRecord, Tier, TierHit
from radix.tiers.remote import RemoteStore

PERSIST_CHUNK = 64  # pages read from the pool at a time when writing it down at close
REMOTE_KNOWN = 100_000  # keys remembered as in the remote store (not written again)


class PageIO(Protocol):
    """Copies KV between pool pages and bytes (the engine's KV pool implements it)."""

    def read_pages(self, pages: Sequence[int]) -> list[bytes]: ...

    def write_pages(self, pages: Sequence[int], data: Sequence[bytes]) -> None: ...


@dataclass(frozen=True, slots=True)
class TierStats:
    """Tier contents now (pages, bytes, budgets) and monotone counters: pages written to
    each tier, pages loaded back from each, pages that fell off the bottom (``dropped``),
    disk files found damaged (``corrupt``), disk writes that failed (``disk_write_errors``), loads refused as slower than recomputing
    (``skipped_slow``); and the measured costs that decide loads (seconds per page)."""

    host_pages: int
    host_bytes: int
    host_budget_bytes: int
    disk_pages: int
    disk_bytes: int
    disk_budget_bytes: int
    written_host: int
    written_disk: int
    loaded_host: int
    loaded_disk: int
    dropped: int
    corrupt: int
    disk_write_errors: int
    skipped_slow: int
    load_s_per_page_host: float | None
    load_s_per_page_disk: float | None
    compute_s_per_page: float | None
    remote: bool = False  # a remote store is configured
    written_remote: int = 0
    loaded_remote: int = 0
    remote_corrupt: int = 0  # values found damaged or foreign (misses)
    remote_errors: int = 0  # calls that failed (the store then rests, see remote.py)
    remote_dropped: int = 0  # writes given up (queue full, server failing)
    load_s_per_page_remote: float | None = None


class KVTiers:
    """The hierarchy under one pool: a host store, a disk store, a remote store (at least
    one)."""

    def __init__(
        self,
        io: PageIO,
        page_size: int,
        host: HostStore | None = None,
        disk: DiskStore | None = None,
        remote: RemoteStore | None = None,
    ) -> None:
        if host is None and disk is None and remote is None:
            raise ValueError("tiers: give a host store, a disk store or a remote store")
        self._io = io
        self._host = host
        self._disk = disk
        self._remote = remote
        self._remote_known: OrderedDict[int, None] = OrderedDict()
        self.cost = LoadCost(page_size)
        self._written = {Tier.HOST: 0, Tier.DISK: 0}
        self._loaded = {Tier.HOST: 0, Tier.DISK: 0, Tier.REMOTE: 0}
        self._dropped = 0
        self._skipped_slow = 0
        self._listeners: list[Callable[[TierChanged], None]] = []
        if host is not None:
            host.watch(lambda added, removed: self._announce(Tier.HOST, added, removed))
        if disk is not None:
            disk.watch(lambda added, removed: self._announce(Tier.DISK, added, removed))

    def subscribe(self, listener: Callable[[TierChanged], None]) -> None:
        """Call ``listener`` with every ``TierChanged`` from now on; it first hears what each
        tier holds already (a restarted engine's disk), so it never misses a page."""
        for tier, store in ((Tier.HOST, self._host), (Tier.DISK, self._disk)):
            if store is not None and len(store):
                listener(TierChanged(tier, store.keys(), ()))
        self._listeners.append(listener)

    def _announce(self, tier: Tier, added: Sequence[int], removed: Sequence[int]) -> None:
        if self._listeners:
            event = TierChanged(tier, added, removed)
            for listener in self._listeners:
                listener(event)

    @property
    def host(self) -> HostStore | None:
        return self._host

    @property
    def disk(self) -> DiskStore | None:
        return self._disk

    @property
    def remote(self) -> RemoteStore | None:
        return self._remote

    def where(self, key: int) -> Tier | None:
        if self._host is not None and key in self._host:
            return Tier.HOST
        if self._disk is not None and key in self._disk:
            return Tier.DISK
        return None

    # ------------------------------------------------------------------ down

    def write_back(self, evicted: Sequence[EvictedPage]) -> None:
        """Pages leaving the pool (their ids still hold their KV): copy down the ones not
        below already."""
        if self._host is None and self._disk is None:
            return  # only a remote store: written when the tree gained each page
        missing = []
        for page in evicted:
            if self._host is not None and page.key in self._host:
                self._host.touch(page.key)
            elif self._disk is not None and page.key in self._disk:
                self._disk.touch(page.key)
            else:
                missing.append(page)
        if not missing:
            return
        data = self._io.read_pages([page.page for page in missing])
        for page, blob in zip(missing, data):
            self._store(PageRecord(page.key, page.tokens, blob))

    def share(self, pages: Sequence[EvictedPage]) -> None:
        """Pages the tree just gained (their pool ids hold their KV): queue a copy of each not
        known to be in the remote store already (a step waits for the pool read, never for
        the network)."""
        remote = self._remote
        if remote is None or not remote.available:
            return
        known = self._remote_known
        fresh = [page for page in pages if page.key not in known]
        if not fresh:
            return
        queued = []
        for page, blob in zip(fresh, self._io.read_pages([page.page for page in fresh])):
            if remote.put(PageRecord(page.key, page.tokens, blob)):
                queued.append(page.key)
        self._know_remote(queued)

    def _know_remote(self, keys: Sequence[int]) -> None:
        """``keys`` are in the remote store, just written or read (the store's LRU keeps
        them longest): remember the most recent ``REMOTE_KNOWN`` and announce them all, so
        a follower orders the store's pages by their last use as the store does."""
        known = self._remote_known
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        removed = []
        while len(known) > REMOTE_KNOWN:
            removed.append(known.popitem(last=False)[0])
        if keys or removed:
            self._announce(Tier.REMOTE, keys, removed)

    def _forget_remote(self, keys: Sequence[int]) -> None:
        """``keys`` were found missing in the remote store (its policy evicted them)."""
        known = self._remote_known
        removed = [key for key in keys if known.pop(key, 0) is None]
        if removed:
            self._announce(Tier.REMOTE, (), removed)

    def persist(self, pages: Sequence[EvictedPage]) -> None:
        """Before shutdown: every record of the host store and the given pool pages go to
        disk (what is there already stays), so a restarted engine finds them."""
        if self._disk is None:
            return
        if self._host is not None:
            for record in self._host.drain():
                self._to_disk(record)
        missing = [page for page in pages if page.key not in self._disk]
        for start in range(0, len(missing), PERSIST_CHUNK):  # bounded copies, not the pool
            chunk = missing[start : start + PERSIST_CHUNK]
            for page, blob in zip(chunk, self._io.read_pages([page.page for page in chunk])):
                self._to_disk(PageRecord(page.key, page.tokens, blob))
        self._disk.flush()

    def _store(self, record: PageRecord) -> None:
        if self._host is None and self._disk is None:
            return  # only a remote store: the page went there when the tree gained it
        if self._host is None:
            self._to_disk(record)
            return
        self._written[Tier.HOST] += 1
        for old in self._host.put(record):
            if old is record:
                self._written[Tier.HOST] -= 1
            self._to_disk(old)

    def _to_disk(self, record: PageRecord) -> None:
        if self._disk is not None and self._disk.put(record):
            self._written[Tier.DISK] += 1
        else:
            self._dropped += 1

    # ------------------------------------------------------------------ up

    def lookup(self, seed: int, buf: bytes, page_bytes: int) -> list[TierHit]:
        """The pages of ``buf`` (canonical token bytes, whole pages, continuing the chain at
        ``seed``) found below the pool, in order, up to the first that is missing or not
        worth loading."""
        hits: list[TierHit] = []
        keys = chain_hashes(buf, page_bytes, seed)
        in_remote: list[bool] | None = None
        for i, key in enumerate(keys):
            tier = self.where(key)
            if tier is None and self._remote is not None:
                if in_remote is None:  # one round trip for the rest of the prompt
                    if not self.cost.pays(Tier.REMOTE):
                        self._skipped_slow += 1
                        break
                    in_remote = [False] * i + self._ask_remote(keys[i:])
                tier = Tier.REMOTE if in_remote[i] else None
            if tier is None:
                break
            if not self.cost.pays(tier):
                self._skipped_slow += 1
                break
            hits.append(TierHit(key, buf[i * page_bytes : (i + 1) * page_bytes], tier))
        return hits

    def _ask_remote(self, keys: Sequence[int]) -> list[bool]:
        """Which of ``keys`` the remote store holds; known keys it answered missing are
        forgotten (an answer that did not come is all misses and forgets nothing)."""
        assert self._remote is not None
        held = self._remote.contains_many(keys)
        if held is None:
            return [False] * len(keys)
        known = self._remote_known
        self._forget_remote([key for key, there in zip(keys, held) if not there and key in known])
        return held

    def fetch(self, hits: Sequence[TierHit]) -> list[FetchedPage]:
        """The records of ``hits``, in order, up to the first that cannot be read, each with
        the seconds its read took."""
        fetched: list[FetchedPage] = []
        started = time.perf_counter()
        remote = self._remote_records(hits)
        remote_s = (time.perf_counter() - started) / max(1, len(remote))
        for hit in hits:
            started = time.perf_counter()
            if hit.tier is Tier.REMOTE:
                record, read_s = remote.get(hit.key), remote_s
            else:
                record = self._read(hit)
                read_s = time.perf_counter() - started
            if record is None:
                break
            fetched.append(FetchedPage(record, hit.tier, read_s))
        return fetched

    def _remote_records(self, hits: Sequence[TierHit]) -> dict[int, PageRecord]:
        """The remote hits' records, read in one round trip (its time shared among them)."""
        wanted = [hit for hit in hits if hit.tier is Tier.REMOTE]
        if not wanted or self._remote is None:
            return {}
        records = self._remote.get_many([h.key for h in wanted], [h.tokens for h in wanted])
        if records is None:
            return {}
        found = {hit.key: record for hit, record in zip(wanted, records) if record is not None}
        self._forget_remote([hit.key for hit in wanted if hit.key not in found])
        self._know_remote(list(found))
        return found

    def install(self, pages: Sequence[int], fetched: Sequence[FetchedPage]) -> None:
        """Copy fetched records into pool ``pages`` (fresh ones, of the caller's handle);
        each page's load cost (its read and its share of the copy) goes to the cost model."""
        started = time.perf_counter()
        self._io.write_pages(pages, [page.record.data for page in fetched])
        copy_s = (time.perf_counter() - started) / max(1, len(pages))
        for page in fetched:
            self._loaded[page.tier] += 1
            self.cost.observe_load(page.tier, 1, page.read_s + copy_s)

    def _read(self, hit: TierHit) -> PageRecord | None:
        if hit.tier is Tier.HOST and self._host is not None:
            record = self._host.get(hit.key)
            if record is not None and record.tokens == hit.tokens:
                return record
            return None
        if self._disk is not None:
            return self._disk.get(hit.key, hit.tokens)
        return None

    # ------------------------------------------------------------------ upkeep

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """A forward pass computed ``tokens`` prefill tokens in ``seconds``."""
        self.cost.observe_compute(tokens, seconds)

    def stats(self) -> TierStats:
        host, disk = self._host, self._disk  # `is not None`: an empty store is falsy (len 0)
        return TierStats(
            host_pages=len(host) if host is not None else 0,
            host_bytes=host.used_bytes if host is not None else 0,
            host_budget_bytes=host.budget_bytes if host is not None else 0,
            disk_pages=len(disk) if disk is not None else 0,
            disk_bytes=disk.used_bytes if disk is not None else 0,
            disk_budget_bytes=disk.budget_bytes if disk is not None else 0,
            written_host=self._written[Tier.HOST],
            # pages whose write failed (a full disk) were never written
            written_disk=self._written[Tier.DISK] - (disk.write_errors if disk is not None else 0),
            loaded_host=self._loaded[Tier.HOST],
            loaded_disk=self._loaded[Tier.DISK],
            dropped=self._dropped + (disk.evicted if disk is not None else 0),
            corrupt=disk.corrupt if disk is not None else 0,
            disk_write_errors=disk.write_errors if disk is not None else 0,
            skipped_slow=self._skipped_slow,
            load_s_per_page_host=self.cost.load_s_per_page(Tier.HOST),
            load_s_per_page_disk=self.cost.load_s_per_page(Tier.DISK),
            compute_s_per_page=self.cost.compute_s_per_page,
            **self._remote_stats(),
        )

    def _remote_stats(self) -> dict[str, object]:
        remote = self._remote
        if remote is None:
            return {}
        return {
            "remote": True,
            "written_remote": remote.written,
            "loaded_remote": self._loaded[Tier.REMOTE],
            "remote_corrupt": remote.corrupt,
            "remote_errors": remote.errors,
            "remote_dropped": remote.dropped,
            "load_s_per_page_remote": self.cost.load_s_per_page(Tier.REMOTE),
        }

    def check(self) -> None:
        """Each tier within its budget and its counts; host and disk hold disjoint keys."""
        if self._host is not None:
            self._host.check()
        if self._disk is not None:
            self._disk.check()
            if self._host is not None:
                both = set(self._host.keys()) & set(self._disk.keys())
                assert not both, f"{len(both)} pages both in host memory and on disk"

    def flush(self) -> None:
        if self._disk is not None:
            self._disk.flush()
        if self._remote is not None:
            self._remote.flush()

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()
        if self._remote is not None:
            self._remote.close()
