"""The remote tier: pages in one store that every engine with the same model reads and writes.

A page goes under ``<store_key>:<content address>``: the store key names the model, dtype and
KV layout (what the disk tier's key names), the content address is the namespace-seeded chain
hash of the whole prefix, so an engine of another model never finds it and a tenant's key is
never another tenant's. A value is the disk tier's record (header, the page's tokens, its KV,
an xxh3 checksum): a damaged, truncated or foreign value, or tokens that differ, is a miss
(counted), never wrong KV.

The network is never waited on by a step for long, and never for a write: writes go through a
bounded queue to one writer thread (a full queue drops the page, counted); reads and lookups
run on the caller's thread with the client's short timeouts. Any error makes the tier a miss
and closes it for ``retry_after_s`` (no calls at all), then it is tried again: a server that is
down or slow costs a warning and misses, not failed requests or a stalled loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from radix.tiers.disk import decode_record, encode_record
from radix.tiers.record import PageRecord

log = logging.getLogger("radixkv.kv_remote")
RETRY_AFTER_S = 5.0
QUEUE_PAGES = 256  # pages waiting to be written before new ones are dropped
WRITE_BATCH = 16  # pages sent in one round trip


class RemoteClient(Protocol):
    """What the remote tier needs of a key-value server (``engine.serving.kv_remote`` has
    Redis' ): each call raises on any failure (refused, timed out, lost)."""

    def exists_many(self, keys: Sequence[str]) -> list[bool]: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> None: ...

    def close(self) -> None: ...


class RemoteStore:
    """Page records in a remote key-value store under ``store_key``."""

    def __init__(
        self,
        client: RemoteClient,
        store_key: str,
        retry_after_s: float = RETRY_AFTER_S,
        queue_pages: int = QUEUE_PAGES,
        capacity_pages: int | None = None,
    ) -> None:
        if not store_key or not all(c.isalnum() or c in "-_." for c in store_key):
            raise ValueError(f"store_key: must be a non-empty name, got {store_key!r}")
        self._client = client
        # Pages the store keeps at most (its own budget; None: unbounded or unknown): a router
        # trusts only that many of the most recently announced pages.
        self.capacity_pages = capacity_pages
        self._prefix = f"radixkv:{store_key}:"
        self._retry_after_s = retry_after_s
        self._closed_until = 0.0  # monotonic time before which the server is not asked
        self._lock = threading.Lock()  # the counters and the breaker, shared with the writer
        self._drained = threading.Condition(self._lock)  # notified when nothing is queued
        self._queue: queue.Queue[PageRecord | None] = queue.Queue(maxsize=queue_pages)
        self._queued: set[int] = set()  # keys waiting in the queue (no second copy)
        self.written = 0
        self.read = 0
        self.corrupt = 0  # values found damaged, foreign or of other tokens
        self.errors = 0  # calls that failed (the tier was then closed for a while)
        self.dropped = 0  # writes given up: the queue was full or the server failed
        self._writer = threading.Thread(
            target=self._write_loop, name="radixkv-kv-remote", daemon=True
        )
        self._writer.start()

    def key_of(self, key: int) -> str:
        return f"{self._prefix}{key:016x}"

    # ------------------------------------------------------------------ the breaker

    @property
    def available(self) -> bool:
        """False while the server is closed after a failure."""
        return time.monotonic() >= self._closed_until

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            first = self._closed_until == 0.0 or time.monotonic() >= self._closed_until + 60
            self._closed_until = time.monotonic() + self._retry_after_s
        if first:
            log.warning("remote KV tier: %s failed (%s); misses for %.0f s, then tried again",
                        what, exc, self._retry_after_s)

    # ------------------------------------------------------------------ reads

    def contains_many(self, keys: Sequence[int]) -> list[bool] | None:
        """Which of ``keys`` the store holds; None (no answer: all misses) while it is closed
        or failing."""
        if not keys:
            return []
        if not self.available:
            return None
        try:
            return list(self._client.exists_many([self.key_of(k) for k in keys]))
        except Exception as exc:  # noqa: BLE001 - any failure of the server is a miss
            self._failed("a lookup", exc)
            return None

    def get_many(
        self, keys: Sequence[int], tokens: Sequence[bytes]
    ) -> list[PageRecord | None] | None:
        """The records of ``keys`` whose value is whole, undamaged and of ``tokens`` (None
        where not); None (no answer) while the store is closed or failing."""
        if not keys:
            return []
        if not self.available:
            return None
        try:
            values = self._client.get_many([self.key_of(k) for k in keys])
        except Exception as exc:  # noqa: BLE001
            self._failed("a read", exc)
            return None
        out: list[PageRecord | None] = []
        for key, want, raw in zip(keys, tokens, values):
            record = None if raw is None else decode_record(bytes(raw), key)
            if raw is not None and (record is None or record.tokens != want):
                record = None
                with self._lock:
                    self.corrupt += 1
            if record is not None:
                with self._lock:
                    self.read += 1
            out.append(record)
        return out

    # ------------------------------------------------------------------ writes

    def put(self, record: PageRecord) -> bool:
        """Queue ``record`` for the writer; False (dropped, counted) when the queue is full,
        the store is closed or the record is queued already."""
        with self._lock:
            if record.key in self._queued:
                return False
            if not self.available:
                self.dropped += 1
                return False
            self._queued.add(record.key)
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self._lock:
                self._queued.discard(record.key)
                self.dropped += 1
                if not self._queued:
                    self._drained.notify_all()
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < WRITE_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
            self._write(batch)

    def _write(self, batch: list[PageRecord]) -> None:
        try:
            if not self.available:
                raise ConnectionError("the store is closed after a failure")
            self._client.set_many([(self.key_of(r.key), encode_record(r)) for r in batch])
            with self._lock:
                self.written += len(batch)
        except Exception as exc:  # noqa: BLE001
            if self.available:
                self._failed("a write", exc)
            with self._lock:
                self.dropped += len(batch)
        finally:
            with self._lock:
                self._queued.difference_update(r.key for r in batch)
                if not self._queued:
                    self._drained.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (at most ``timeout_s``) until the queued writes are done; True if they are."""
        with self._drained:
            return self._drained.wait_for(lambda: not self._queued, timeout_s)

    def close(self) -> None:
        """Send what is queued (briefly), stop the writer, close the connection."""
        self.flush(timeout_s=2.0)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass  # the writer is stuck on a dead server: it is a daemon thread
        self._writer.join(timeout=2.0)
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass
