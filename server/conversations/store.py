"""Conversations of ``/v1/conversations``: items in order, per tenant, in SQLite.

A conversation is an ordered list of items (messages, function calls and their outputs, in
the shapes ``/v1/responses`` lists them) with ``metadata``; a ``/v1/responses`` turn given
``conversation`` reads its items as the context and appends its input and output. Rows belong
to a tenant (the ``cache_salt``; "" for none), as stored responses do: another tenant's lookup
finds nothing. A turn also leaves its token ids (``Continuation``): while no item was added or
deleted since, the next turn's prompt starts with exactly those ids and finds them cached.

The file sits beside the response store's (``conversations.sqlite3``; in memory when that is),
created readable by its owner only, opened as the response store's is (``StoreFile``: no
memory-mapped file, failures raised as ``StoreUnavailable``: a 503 naming the file). Each tenant is bounded (conversations, and the
bytes of its items) by counters kept in the same transaction as the rows, never by scanning;
past a bound a write is refused (``ConversationStoreFull``: a 400 naming the field), never
another tenant's. Every call takes one lock; the endpoints call it on a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from server.responses.store import MEMORY, StoreFile, StoreUnavailable

FILE_NAME = "conversations.sqlite3"
MAX_CONVERSATIONS_PER_TENANT = 10_000
MAX_BYTES_PER_TENANT = 256 << 20


class Conversation(msgspec.Struct, frozen=True):
    id: str
    created_at: int
    metadata: dict[str, str]

    def body(self) -> dict[str, Any]:
        """As OpenAI returns a conversation."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


class Continuation(msgspec.Struct, frozen=True):
    """The token ids the last turn ran (prompt and reply) and the items they cover."""

    token_ids: list[int]
    items: int  # how many items the conversation had after that turn
    last_item: str  # the id of its last item then


class ConversationStoreFull(Exception):
    """A tenant's conversations or their items are at the store's bound."""


def store_path(responses_path: str) -> str:
    """The conversations' file beside the response store's (in memory when it is)."""
    if responses_path == MEMORY:
        return MEMORY
    return str(Path(responses_path).with_name(FILE_NAME))


class ConversationStore(StoreFile):
    """Conversations and their items, per tenant, within each tenant's bounds."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_conversations: int = MAX_CONVERSATIONS_PER_TENANT,
        max_bytes: int = MAX_BYTES_PER_TENANT,
    ) -> None:
        super().__init__(path, "conversation store", "conversation_store_unavailable")
        self.max_conversations = max_conversations
        self.max_bytes = max_bytes
        try:
            with self._using():
                self._create_tables()
        except StoreUnavailable:
            self.close()
            raise
        self._encode = msgspec.json.Encoder().encode
        self._item = msgspec.json.Decoder(dict[str, Any]).decode
        self._metadata = msgspec.json.Decoder(dict[str, str]).decode
        self._continuation = msgspec.json.Decoder(Continuation).decode

    def _create_tables(self) -> None:
        self._db.executescript(
                "CREATE TABLE IF NOT EXISTS conversations (id TEXT PRIMARY KEY, tenant TEXT NOT "
                "NULL, created_at INTEGER NOT NULL, metadata BLOB NOT NULL, next_seq INTEGER NOT "
                "NULL, continuation BLOB);"
                "CREATE TABLE IF NOT EXISTS items (conversation TEXT NOT NULL, seq INTEGER NOT "
                "NULL, id TEXT NOT NULL, size INTEGER NOT NULL, item BLOB NOT NULL, PRIMARY KEY "
                "(conversation, seq));"
                "CREATE UNIQUE INDEX IF NOT EXISTS items_by_id ON items (conversation, id);"
                "CREATE TABLE IF NOT EXISTS usage (tenant TEXT PRIMARY KEY, conversations "
                "INTEGER NOT NULL, bytes INTEGER NOT NULL);"
            )

    # ------------------------------------------------------------------ conversations

    def create(
        self, conversation: Conversation, tenant: str, items: Sequence[dict[str, Any]]
    ) -> None:
        """Store a new conversation with its first ``items``; ConversationStoreFull past the
        tenant's bounds."""
        rows = [(item["id"], self._encode(item)) for item in items]
        with self._writing():
            conversations, used = self._usage(tenant)
            if conversations >= self.max_conversations:
                raise ConversationStoreFull(
                    f"this tenant holds {conversations} conversations, the most it may; "
                    "delete some (DELETE /v1/conversations/{id})"
                )
            self._db.execute(
                "INSERT INTO conversations VALUES (?, ?, ?, ?, 0, NULL)",
                (conversation.id, tenant, conversation.created_at,
                 self._encode(conversation.metadata)),
            )
            self._db.execute(
                "INSERT INTO usage VALUES (?, 1, 0) ON CONFLICT (tenant) DO UPDATE SET "
                "conversations = conversations + 1", (tenant,)
            )
            self._append(conversation.id, tenant, rows, used)

    def get(self, conversation_id: str, tenant: str) -> Conversation | None:
        with self._using():
            row = self._row(conversation_id, tenant, "created_at, metadata")
        if row is None:
            return None
        return Conversation(conversation_id, row[0], self._decoded(self._metadata, row[1]))

    def update(
        self, conversation_id: str, tenant: str, metadata: dict[str, str]
    ) -> Conversation | None:
        with self._using():
            cursor = self._db.execute(
                "UPDATE conversations SET metadata = ? WHERE id = ? AND tenant = ?",
                (self._encode(metadata), conversation_id, tenant),
            )
        return self.get(conversation_id, tenant) if cursor.rowcount else None

    def delete(self, conversation_id: str, tenant: str) -> bool:
        with self._writing():
            if self._row(conversation_id, tenant, "1") is None:
                return False
            freed = self._db.execute(
                "SELECT COALESCE(SUM(size), 0) FROM items WHERE conversation = ?",
                (conversation_id,),
            ).fetchone()[0]
            self._db.execute("DELETE FROM items WHERE conversation = ?", (conversation_id,))
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            self._db.execute(
                "UPDATE usage SET conversations = conversations - 1, bytes = bytes - ? "
                "WHERE tenant = ?", (freed, tenant),
            )
        return True

    # ------------------------------------------------------------------ items

    def add_items(
        self, conversation_id: str, tenant: str, items: Sequence[dict[str, Any]]
    ) -> bool:
        """Append ``items``; False when there is no such conversation (of this tenant)."""
        rows = [(item["id"], self._encode(item)) for item in items]
        with self._writing():
            if self._row(conversation_id, tenant, "1") is None:
                return False
            self._append(conversation_id, tenant, rows, self._usage(tenant)[1])
        return True

    def items(self, conversation_id: str, tenant: str) -> list[dict[str, Any]] | None:
        """Every item, oldest first (None: no such conversation)."""
        with self._using():
            if self._row(conversation_id, tenant, "1") is None:
                return None
            rows = self._db.execute(
                "SELECT item FROM items WHERE conversation = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
        return [self._decoded(self._item, row[0]) for row in rows]

    def page(
        self, conversation_id: str, tenant: str, order: str, after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], bool] | None:
        """Up to ``limit`` items in ``order`` ("asc" or "desc") after the item ``after``, and
        whether more follow. None: no such conversation; KeyError: no item ``after``."""
        direction, compare = ("ASC", ">") if order == "asc" else ("DESC", "<")
        with self._using():
            if self._row(conversation_id, tenant, "1") is None:
                return None
            where, args = "conversation = ?", [conversation_id]
            if after is not None:
                found = self._db.execute(
                    "SELECT seq FROM items WHERE conversation = ? AND id = ?",
                    (conversation_id, after),
                ).fetchone()
                if found is None:
                    raise KeyError(after)
                where += f" AND seq {compare} ?"
                args.append(found[0])
            rows = self._db.execute(
                f"SELECT item FROM items WHERE {where} ORDER BY seq {direction} LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        return [self._decoded(self._item, row[0]) for row in rows[:limit]], len(rows) > limit

    def item(self, conversation_id: str, tenant: str, item_id: str) -> dict[str, Any] | None:
        with self._using():
            if self._row(conversation_id, tenant, "1") is None:
                return None
            row = self._db.execute(
                "SELECT item FROM items WHERE conversation = ? AND id = ?",
                (conversation_id, item_id),
            ).fetchone()
        return None if row is None else self._decoded(self._item, row[0])

    def delete_item(self, conversation_id: str, tenant: str, item_id: str) -> bool:
        with self._writing():
            if self._row(conversation_id, tenant, "1") is None:
                return False
            row = self._db.execute(
                "SELECT size FROM items WHERE conversation = ? AND id = ?",
                (conversation_id, item_id),
            ).fetchone()
            if row is None:
                return False
            self._db.execute(
                "DELETE FROM items WHERE conversation = ? AND id = ?", (conversation_id, item_id)
            )
            self._db.execute(
                "UPDATE usage SET bytes = bytes - ? WHERE tenant = ?", (row[0], tenant)
            )
        return True

    # ------------------------------------------------------------------ turns

    def continuation(self, conversation_id: str, tenant: str) -> list[int] | None:
        """The last turn's token ids while they still cover every item (None otherwise)."""
        with self._using():
            row = self._row(conversation_id, tenant, "continuation")
            if row is None or row[0] is None:
                return None
            kept = self._decoded(self._continuation, row[0])
            count, last = self._db.execute(
                "SELECT COUNT(*), (SELECT id FROM items WHERE conversation = ?1 ORDER BY seq "
                "DESC LIMIT 1) FROM items WHERE conversation = ?1", (conversation_id,),
            ).fetchone()
        return kept.token_ids if (count, last) == (kept.items, kept.last_item) else None

    def last_turn_ids(self, conversation_id: str, tenant: str) -> list[int] | None:
        """The token ids of the last turn run on the conversation (what it left pinned),
        whether or not items changed since; None without one."""
        with self._using():
            row = self._row(conversation_id, tenant, "continuation")
            if row is None or row[0] is None:
                return None
            return self._decoded(self._continuation, row[0]).token_ids

    def finish_turn(
        self, conversation_id: str, tenant: str, items: Sequence[dict[str, Any]],
        token_ids: list[int],
    ) -> bool:
        """Append a turn's input and output ``items`` and keep its token ids; False when the
        conversation is gone."""
        rows = [(item["id"], self._encode(item)) for item in items]
        with self._writing():
            if self._row(conversation_id, tenant, "1") is None:
                return False
            self._append(conversation_id, tenant, rows, self._usage(tenant)[1])
            count = self._db.execute(
                "SELECT COUNT(*) FROM items WHERE conversation = ?", (conversation_id,)
            ).fetchone()[0]
            kept = Continuation(token_ids, count, items[-1]["id"]) if items else None
            self._db.execute(
                "UPDATE conversations SET continuation = ? WHERE id = ?",
                (None if kept is None else self._encode(kept), conversation_id),
            )
        return True

    # ------------------------------------------------------------------ plumbing

    def _append(
        self, conversation_id: str, tenant: str, rows: list[tuple[str, bytes]], used: int
    ) -> None:
        """Insert ``rows`` at the end (the caller holds the transaction)."""
        if not rows:
            return
        size = sum(len(raw) for _, raw in rows)
        if used + size > self.max_bytes:
            raise ConversationStoreFull(
                f"this tenant's conversations would hold {used + size} bytes of items, more "
                f"than the {self.max_bytes} it may; delete conversations or items"
            )
        (start,) = self._db.execute(
            "SELECT next_seq FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        try:
            self._db.executemany(
                "INSERT INTO items VALUES (?, ?, ?, ?, ?)",
                [(conversation_id, start + k, item_id, len(raw), raw)
                 for k, (item_id, raw) in enumerate(rows)],
            )
        except sqlite3.IntegrityError:
            raise ValueError("an item id is in this conversation already") from None
        self._db.execute(
            "UPDATE conversations SET next_seq = ? WHERE id = ?",
            (start + len(rows), conversation_id),
        )
        self._db.execute("UPDATE usage SET bytes = bytes + ? WHERE tenant = ?", (size, tenant))

    def _row(self, conversation_id: str, tenant: str, columns: str) -> Any:
        return self._db.execute(
            f"SELECT {columns} FROM conversations WHERE id = ? AND tenant = ?",
            (conversation_id, tenant),
        ).fetchone()

    def _usage(self, tenant: str) -> tuple[int, int]:
        row = self._db.execute(
            "SELECT conversations, bytes FROM usage WHERE tenant = ?", (tenant,)
        ).fetchone()
        return (0, 0) if row is None else (row[0], row[1])

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One write transaction under the lock (``StoreFile._transaction``)."""
        with self._using(), self._transaction():
            yield

    def _decoded(self, decode: Any, raw: bytes) -> Any:
        """A stored record's value; bytes that are no record are the store's failure."""
        try:
            return decode(raw)
        except msgspec.MsgspecError:
            raise self._damaged_record() from None
