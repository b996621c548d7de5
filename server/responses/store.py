"""Stored responses of ``/v1/responses`` (``store: true``): one SQLite table, per tenant.

A stored response keeps what its follow-ups need: the conversation so far as chat messages
(``previous_response_id`` continues it), the token ids the engine ran (prompt and reply, so the
next turn's prompt starts with exactly those ids and finds them in the cache), and the
response object ``GET /v1/responses/{id}`` returns. Rows belong to a tenant (the request's
``cache_salt``; "" for none): a lookup under another tenant finds nothing, as if the id did not
exist, so one tenant can neither read, continue nor delete another's.

Durable by default: SQLite (the standard library) in a file under the user's cache folder,
created readable by its owner only, so a server restarted with the same command keeps its
conversations. ``StoreFile`` opens it (for the conversation store too) so that nothing the file
does can kill the server, and makes its failures the store's own (``StoreUnavailable``). Bounded per tenant and in total, as a cache is, never by
refusing one tenant for what another stored: a tenant past its share (``tenant_max_responses``
/ ``tenant_max_bytes``, a quarter of the store's by default) loses its own oldest responses to
its new one, and a full store drops the oldest responses of the tenant holding the most (rows
or bytes, whichever bound binds), so a tenant's stored requests never fail because of another
tenant, and another tenant's responses go only to make room beside a tenant holding as much.
Only a response larger than a tenant's whole byte share is refused (``StoreFullError``). The
usage is kept in a table of counters that SQLite's triggers maintain with every insert and
delete, so a put reads a few indexed rows rather than scanning the table. Every call takes one
lock and is short: the endpoints call it on a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from engine import cache_root

log = logging.getLogger("radixkv.server")

MEMORY = ":memory:"
FILE_NAME = "responses.sqlite3"
# A tenant's share of the store's bounds when none is given: one tenant holds at most this
# fraction of the rows and bytes, so several always fit beside it.
TENANT_SHARE = 4
# The schema's version (PRAGMA user_version): 1 added the counters, their triggers and the
# tenant index to the table of version 0.
SCHEMA = 1

_TABLES = (
    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
    "created_at INTEGER NOT NULL, size INTEGER NOT NULL, record BLOB NOT NULL)",
    # a tenant's rows in insertion order (rowid): its oldest is the first
    "CREATE INDEX IF NOT EXISTS responses_tenant ON responses (tenant)",
    "CREATE TABLE IF NOT EXISTS tenants (tenant TEXT PRIMARY KEY, count INTEGER NOT NULL, "
    "bytes INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS tenants_count ON tenants (count)",
    "CREATE INDEX IF NOT EXISTS tenants_bytes ON tenants (bytes)",
    "CREATE TABLE IF NOT EXISTS totals (one INTEGER PRIMARY KEY CHECK (one = 0), "
    "count INTEGER NOT NULL, bytes INTEGER NOT NULL)",
    "CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses BEGIN "
    "INSERT INTO tenants VALUES (NEW.tenant, 1, NEW.size) ON CONFLICT (tenant) DO UPDATE "
    "SET count = count + 1, bytes = bytes + NEW.size; "
    "UPDATE totals SET count = count + 1, bytes = bytes + NEW.size; END",
    "CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses BEGIN "
    "UPDATE tenants SET count = count - 1, bytes = bytes - OLD.size "
    "WHERE tenant = OLD.tenant; "
    "DELETE FROM tenants WHERE tenant = OLD.tenant AND count <= 0; "
    "UPDATE totals SET count = count - 1, bytes = bytes - OLD.size; END",
)


def default_store_path() -> Path:
    """``responses.sqlite3`` in radixkv's cache folder (``~/.cache/radixkv``)."""
    return cache_root() / FILE_NAME


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    """One stored response. ``history``: the conversation in OpenAI's chat shape (the inputs
    of every turn and the replies; never ``instructions``, which OpenAI does not carry over);
    ``token_ids``: this turn's prompt and reply as the engine ran them; ``body``: the
    response object as the client got it."""

    id: str
    tenant: str
    created_at: int
    history: list[dict[str, Any]]
    token_ids: list[int]
    body: dict[str, Any]
    # The conversation's items before this response's output, oldest first (what
    # ``GET /v1/responses/{id}/input_items`` lists): the earlier turns' inputs and outputs,
    # then this turn's input.
    items: list[dict[str, Any]] = []


class Usage(msgspec.Struct, frozen=True):
    """Responses stored and their bytes (a tenant's, or the store's)."""

    count: int
    bytes: int


class StoreFullError(Exception):
    """A response larger than a tenant's whole share: the client must send store=false."""


# SQLite's primary result codes (``sqlite3.Error.sqlite_errorcode & 0xFF``) that say the file
# itself is no longer the store: another program wrote over it or emptied it. They do not go
# away by retrying, so the store stays unavailable until it is moved away and the server
# restarted (writing on into a damaged file could only damage it further).
_SQLITE_ERROR, _SQLITE_CORRUPT, _SQLITE_NOTADB = 1, 11, 26
_LASTING = {
    _SQLITE_ERROR: "the file no longer holds the store's tables",
    _SQLITE_CORRUPT: "the file is damaged",
    _SQLITE_NOTADB: "the file is no longer a SQLite database",
}


class StoreUnavailable(Exception):
    """The store's file cannot serve a request: damaged, removed or replaced, on a full disk,
    its journal unwritable. The store's failure, not the request's: a 503 naming the file
    (``server.errors.as_api_error``) while requests that do not use the store go on.
    ``lasting``: it stays so until the file is moved away and the server restarted."""

    def __init__(self, name: str, path: str, reason: str, code: str, lasting: bool) -> None:
        self.name, self.path, self.reason, self.code = name, path, reason, code
        self.lasting = lasting
        advice = (
            "requests that use it fail until the file is moved away (or repaired) and the "
            "server restarted" if lasting else "requests that use it fail until it can be "
            "written again"
        )
        super().__init__(
            f"the {name} {path} is unavailable: {reason}; {advice} (the rest of the API, "
            "and store: false, work on)"
        )


class StoreFile:
    """One SQLite file of a store, opened so that no signal from it can reach the process,
    its failures raised as ``StoreUnavailable`` (every call through ``_using``).

    SQLite's WAL mode memory-maps its index (the ``-shm`` file): truncated by another program,
    the next read touches a page that is gone and the kernel sends SIGBUS, which kills the
    server with nothing logged. So the file keeps a rollback journal (``journal_mode=TRUNCATE``:
    no ``-shm`` at all) and ``mmap_size=0`` (the database file is read, never mapped). The price,
    measured on this project's machines: a commit takes about 2 ms instead of about 1 (one more
    fsync), against a generation of tens of milliseconds or more; a reader in another process
    waits while a write commits. Other processes (a second server, the ``sqlite3`` shell) can
    still open the file, as they could under WAL; ``locking_mode=EXCLUSIVE`` would also keep
    the WAL index off the disk, but lock every other process out.

    SQLite goes on reading and writing a file that was removed or replaced under it (the next
    start would not see what it wrote), so each call first checks that the path still names
    the file opened."""

    def __init__(self, path: str | os.PathLike[str], name: str, code: str) -> None:
        self.path = str(path)
        self.name = name  # "response store": how messages and /health call it
        self.code = code  # the 503's error code
        self._lock = threading.Lock()
        self._lasting: str | None = None  # why it is unusable until a restart
        self._failing: str | None = None  # why the last call failed, until one succeeds
        self._identity: tuple[int, int] | None = None
        try:
            if self.path != MEMORY:
                _create_private(Path(self.path))
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            if self.path != MEMORY:
                self._db.execute("PRAGMA mmap_size=0")
                (mode,) = self._db.execute("PRAGMA journal_mode=TRUNCATE").fetchone()
                if mode != "truncate":
                    raise self._unavailable(
                        f"another process holds it in {mode} mode (an older radixkv serve?); "
                        "stop it, or give this server a file of its own", lasting=True,
                    )
                found = os.stat(self.path)
                self._identity = (found.st_dev, found.st_ino)
        except OSError as exc:
            raise self._unavailable(exc.strerror or str(exc), lasting=True) from None
        except sqlite3.Error as exc:
            raise self._unavailable(str(exc), lasting=True) from None

    @contextlib.contextmanager
    def _using(self) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock, while the path still names the file opened; any
        SQLite error inside is the store's (``StoreUnavailable``)."""
        with self._lock:
            self._check_file()
            try:
                yield self._db
            except sqlite3.Error as exc:
                raise self._failed(exc) from None
            if self._failing is not None:
                log.warning("the %s %s works again", self.name, self.path)
                self._failing = None

    def _check_file(self) -> None:
        """StoreUnavailable once the file is unusable for good, or gone from its path."""
        if self._lasting is None and self._identity is not None:
            try:
                found = os.stat(self.path)
                same = (found.st_dev, found.st_ino) == self._identity
            except OSError:
                same = False
            if not same:
                self._note("the file was removed or replaced since the server opened it",
                           lasting=True)
        if self._lasting is not None:
            raise self._unavailable(self._lasting, lasting=True)

    def _failed(self, exc: sqlite3.Error) -> StoreUnavailable:
        """``exc`` as the store's failure, remembered (for /health) and logged once."""
        primary = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        lasting = primary in _LASTING
        reason = f"{_LASTING[primary]} ({exc})" if lasting else str(exc)
        self._note(reason, lasting)
        return self._unavailable(reason, lasting)

    def _damaged_record(self) -> StoreUnavailable:
        """A row SQLite reads whole but whose bytes are not a record: written over."""
        self._note("a stored record is damaged", lasting=False)
        return self._unavailable("a stored record is damaged", lasting=False)

    def _note(self, reason: str, lasting: bool) -> None:
        if (self._lasting if lasting else self._failing) != reason:
            log.warning("the %s %s is unavailable: %s", self.name, self.path, reason)
        if lasting:
            self._lasting = reason
        else:
            self._failing = reason

    def _unavailable(self, reason: str, lasting: bool) -> StoreUnavailable:
        return StoreUnavailable(self.name, self.path, reason, self.code, lasting)

    def health(self) -> str | None:
        """Why the store cannot serve now (None: it can): the file checked, its first page
        read; while a call holds the lock, what the last calls found (a probe never waits)."""
        if not self._lock.acquire(blocking=False):
            return self._lasting or self._failing
        try:
            self._check_file()
            self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except StoreUnavailable as exc:
            return exc.reason
        except sqlite3.Error as exc:
            return self._failed(exc).reason
        finally:
            self._lock.release()
        return self._lasting or self._failing

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction (other processes on the same file wait for it); the caller
        is inside ``_using``. SQLite has rolled back already after some failures (a full
        disk, an I/O error): a second ROLLBACK would hide the first error behind its own."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._db.close()


class ResponseStore(StoreFile):
    """A SQLite table of ``StoredResponse`` rows within ``max_responses`` and ``max_bytes``
    in all and ``tenant_max_responses`` / ``tenant_max_bytes`` per tenant (default: a
    ``TENANT_SHARE``-th of the totals); the oldest give way (see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_responses: int,
        max_bytes: int,
        tenant_max_responses: int | None = None,
        tenant_max_bytes: int | None = None,
    ) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        share = TENANT_SHARE
        self.tenant_max_responses = min(
            tenant_max_responses or max(max_responses // share, 1), max_responses
        )
        self.tenant_max_bytes = min(tenant_max_bytes or max(max_bytes // share, 1), max_bytes)
        super().__init__(path, "response store", "response_store_unavailable")
        try:
            with self._using():
                self._migrate()
        except StoreUnavailable:
            self.close()
            raise
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(StoredResponse)

    def _migrate(self) -> None:
        """The counters' tables and triggers, counted once from the rows a file of an older
        version holds (the only scan of the table; the caller holds the lock)."""
        with self._transaction():
            (version,) = self._db.execute("PRAGMA user_version").fetchone()
            if version >= SCHEMA:
                return
            for statement in _TABLES:
                self._db.execute(statement)
            self._db.execute("DELETE FROM tenants")
            self._db.execute(
                "INSERT INTO tenants SELECT tenant, COUNT(*), SUM(size) FROM responses "
                "GROUP BY tenant"
            )
            self._db.execute(
                "INSERT OR REPLACE INTO totals SELECT 0, COUNT(*), COALESCE(SUM(size), 0) "
                "FROM responses"
            )
            self._db.execute(f"PRAGMA user_version = {SCHEMA}")

    def put(self, response: StoredResponse) -> None:
        """Store ``response`` (a new id), dropping the oldest responses it needs room from
        (its tenant's own past the tenant's share; the fullest tenant's past the store's
        bounds); StoreFullError if it alone is larger than a tenant's share."""
        record = self._encoder.encode(response)
        size = len(record)
        if size > self.tenant_max_bytes:
            raise StoreFullError(
                f"this response takes {size} bytes to store, more than a tenant's share of "
                f"the response store ({self.tenant_max_bytes} bytes)"
            )
        tenant = response.tenant
        with self._using(), self._transaction():
            mine = self._usage(tenant)
            while mine.count + 1 > self.tenant_max_responses or (
                mine.bytes + size > self.tenant_max_bytes
            ):
                self._drop_oldest(tenant)
                mine = self._usage(tenant)
            total = self._usage(None)
            while total.count + 1 > self.max_responses or total.bytes + size > self.max_bytes:
                by = "count" if total.count + 1 > self.max_responses else "bytes"
                (fullest,) = self._db.execute(
                    f"SELECT tenant FROM tenants ORDER BY {by} DESC LIMIT 1"
                ).fetchone()
                self._drop_oldest(fullest)
                total = self._usage(None)
            self._db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
                (response.id, tenant, response.created_at, size, record),
            )

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response ``response_id`` of ``tenant``; None if there is none (or it is
        another tenant's)."""
        with self._using():
            row = self._db.execute(
                "SELECT record FROM responses WHERE id = ? AND tenant = ?",
                (response_id, tenant),
            ).fetchone()
        if row is None:
            return None
        try:
            return self._decoder.decode(row[0])
        except msgspec.MsgspecError:
            raise self._damaged_record() from None

    def delete(self, response_id: str, tenant: str) -> bool:
        """Delete ``tenant``'s response ``response_id``; False if there was none."""
        with self._using():
            cursor = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant)
            )
        return cursor.rowcount > 0

    def usage(self, tenant: str | None = None) -> Usage:
        """What ``tenant`` stores (None: the whole store), from the counters."""
        with self._using():
            return self._usage(tenant)

    def __len__(self) -> int:
        return self.usage().count

    def _usage(self, tenant: str | None) -> Usage:
        """The counters of ``tenant`` (None: the totals); the caller holds the lock."""
        if tenant is None:
            row = self._db.execute("SELECT count, bytes FROM totals").fetchone()
        else:
            row = self._db.execute(
                "SELECT count, bytes FROM tenants WHERE tenant = ?", (tenant,)
            ).fetchone()
        return Usage(0, 0) if row is None else Usage(*row)

    def _drop_oldest(self, tenant: str) -> None:
        """Delete ``tenant``'s oldest response (the triggers count it out)."""
        self._db.execute(
            "DELETE FROM responses WHERE rowid = (SELECT rowid FROM responses WHERE tenant = ? "
            "ORDER BY rowid LIMIT 1)",
            (tenant,),
        )



def _create_private(path: Path) -> None:
    """The file (and its folder) readable by its owner only, created before SQLite opens it
    (SQLite gives its journal files the database file's permissions)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
