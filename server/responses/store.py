"""Stored responses of ``/v1/responses`` (``store: true``): one SQLite table, per tenant.

A stored response keeps what its follow-ups need: the conversation so far as chat messages
(``previous_response_id`` continues it), the token ids the engine ran (prompt and reply, so the
next turn's prompt starts with exactly those ids and finds them in the cache), and the
response object ``GET /v1/responses/{id}`` returns. Rows belong to a tenant (the request's
``cache_salt``; "" for none): a lookup under another tenant finds nothing, as if the id did not
exist, so one tenant can neither read, continue nor delete another's.

Durable by default: SQLite (the standard library) in a file under the user's cache folder,
created readable by its owner only, written in WAL mode, so a server restarted with the same
command keeps its conversations. Bounded: past ``max_responses`` rows or ``max_bytes`` of them a
new response is refused (``StoreFullError``), never silently dropped or evicted. Every call
takes one lock and is short: the endpoints call it on a worker thread.
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


class StoreFullError(Exception):
    """The store holds its limit: the client must delete responses or send store=false."""


class ResponseStore:
    """A SQLite table of ``StoredResponse`` rows within ``max_responses`` and ``max_bytes``."""

    def __init__(self, path: str | os.PathLike[str], max_responses: int, max_bytes: int) -> None:
        self.path = str(path)
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        if self.path != MEMORY:
            _create_private(Path(self.path))
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            if self.path != MEMORY:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, tenant TEXT NOT "
                "NULL, created_at INTEGER NOT NULL, size INTEGER NOT NULL, record BLOB NOT NULL)"
            )
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(StoredResponse)

    def room_for(self) -> bool:
        """Whether one more response fits (one of 0 bytes: ``put`` checks its size)."""
        with self._lock:
            count, total = self._usage()
        return count < self.max_responses and total <= self.max_bytes

    def put(self, response: StoredResponse) -> None:
        """Store ``response`` (a new id); StoreFullError past the limits."""
        record = self._encoder.encode(response)
        with self._lock:
            count, total = self._usage()
            if count >= self.max_responses or total + len(record) > self.max_bytes:
                raise StoreFullError(
                    f"the response store is full ({count} responses, {total} of "
                    f"{self.max_bytes} bytes, at most {self.max_responses} responses)"
                )
            self._db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
                (response.id, response.tenant, response.created_at, len(record), record),
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

    def __len__(self) -> int:
        with self._lock:
            return int(self._usage()[0])

    def _usage(self) -> tuple[int, int]:
        """How many responses are stored and their bytes (the caller holds the lock)."""
        count, total = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
        ).fetchone()
        return count, total

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._db.close()


def _create_private(path: Path) -> None:
    """The file (and its folder) readable by its owner only, created before SQLite opens it
    (SQLite gives its journal files the database file's permissions)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
