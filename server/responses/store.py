"""Stored responses of ``/v1/responses`` (``store: true``): one SQLite table, per tenant.

A stored response keeps what its follow-ups need: the conversation so far as chat messages
(``previous_response_id`` continues it), the token ids the engine ran (prompt and reply, so the
next turn's prompt starts with exactly those ids and finds them in the cache), and the
response object ``GET /v1/responses/{id}`` returns. Rows belong to a tenant (the request's
``cache_salt``; "" for none): a lookup under another tenant finds nothing, as if the id did not
exist, so one tenant can neither read, continue nor delete another's.

Durable by default: SQLite (the standard library) in a file under the user's cache folder,
created readable by its owner only, written in WAL mode, so a server restarted with the same
command keeps its conversations. Bounded per tenant and in total, as a cache is, never by
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
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import msgspec

from engine import cache_root

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


class ResponseStore:
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
        self.path = str(path)
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        share = TENANT_SHARE
        self.tenant_max_responses = min(
            tenant_max_responses or max(max_responses // share, 1), max_responses
        )
        self.tenant_max_bytes = min(tenant_max_bytes or max(max_bytes // share, 1), max_bytes)
        if self.path != MEMORY:
            _create_private(Path(self.path))
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            if self.path != MEMORY:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._migrate()
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

    @contextlib.contextmanager
    def _transaction(self) -> Any:
        """One write transaction (other processes on the same file wait for it)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

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
        with self._lock, self._transaction():
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
        with self._lock:
            row = self._db.execute(
                "SELECT record FROM responses WHERE id = ? AND tenant = ?",
                (response_id, tenant),
            ).fetchone()
        return None if row is None else self._decoder.decode(row[0])

    def delete(self, response_id: str, tenant: str) -> bool:
        """Delete ``tenant``'s response ``response_id``; False if there was none."""
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant)
            )
        return cursor.rowcount > 0

    def usage(self, tenant: str | None = None) -> Usage:
        """What ``tenant`` stores (None: the whole store), from the counters."""
        with self._lock:
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

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._db.close()


def _create_private(path: Path) -> None:
    """The file (and its folder) readable by its owner only, created before SQLite opens it
    (SQLite gives its journal files the database file's permissions)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
