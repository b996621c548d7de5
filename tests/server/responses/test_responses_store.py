"""Stored responses over an engine in this process: a stored conversation stays pinned, so its
next turn hits though other traffic filled the pool between the turns (and misses with pins
off); the store is bounded per tenant and in all, making room from the oldest responses of
the tenant that needs it (or holds the most), never by failing another tenant's request, and
counts its usage in counters rather than scans; the store's file is its owner's only; every
page is accounted for at idle."""

from __future__ import annotations

import os
import sqlite3
import stat
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from starlette.testclient import TestClient

from engine import Engine
from server import ServerConfig, create_app
from server.responses.store import ResponseStore, StoredResponse, StoreFullError

DOCUMENT = " ".join(f"Clause {i}: the tenant keeps the garden of plot {i} tidy." for i in range(8))
FILLERS = [
    " ".join(f"Filler {d}.{i}: {w} number {i * 3}." for i in range(14))
    for d, w in enumerate(["oak", "elm", "ash", "yew"])
]


def second_turn_cached(loaded_fp32: Any, ttl: float, tmp_path: Path) -> int:
    """Turn 1 (stored), fillers that overflow a 24-page pool, turn 2 by previous_response_id:
    turn 2's cached tokens."""
    engine = Engine(model=loaded_fp32, page_size=16, num_pages=24)
    config = ServerConfig(
        model_name="m", response_store=str(tmp_path / f"store-{ttl}.sqlite3"), response_ttl=ttl
    )
    with engine, TestClient(create_app(engine, config)) as client:
        first = client.post("/v1/responses", json={
            "input": DOCUMENT + "\nWho keeps plot 3?", "max_output_tokens": 6,
            "temperature": 0,
        }).json()
        for filler in FILLERS:
            reply = client.post("/v1/completions", json={"prompt": filler, "max_tokens": 2})
            assert reply.status_code == 200
        second = client.post("/v1/responses", json={
            "input": "And plot 5?", "previous_response_id": first["id"],
            "max_output_tokens": 4, "temperature": 0,
        }).json()
        assert engine.wait_idle(30)
        pages = engine.stats().pages
        assert pages.private == 0 and pages.free + pages.cached == pages.total
        return second["usage"]["input_tokens_details"]["cached_tokens"]


def test_a_stored_conversation_stays_warm_through_traffic_that_fills_the_pool(
    loaded_fp32: Any, tmp_path: Path
) -> None:
    pinned = second_turn_cached(loaded_fp32, 300.0, tmp_path)
    unpinned = second_turn_cached(loaded_fp32, 0.0, tmp_path)
    assert unpinned == 0, "with pins off the fillers should have evicted the conversation"
    assert pinned >= 112, f"the pinned conversation should hit: {pinned} cached tokens"


def test_one_tenant_filling_its_share_never_makes_store_fail_for_another(
    loaded_fp32: Any,
) -> None:
    """Issue 60 #3: one tenant's flood used to fill the shared store, after which every
    tenant's ``store: true`` was a 400. Now the flooding tenant loses its own oldest
    responses, and the others store as before."""
    engine = Engine(model=loaded_fp32, num_pages=64)
    config = ServerConfig(model_name="m", response_store=":memory:", response_store_max=8)
    with engine, TestClient(create_app(engine, config)) as client:
        body = {"input": "Hi.", "max_output_tokens": 1}
        flood = [client.post("/v1/responses", json={**body, "cache_salt": "flood"})
                 for _ in range(12)]
        assert [r.status_code for r in flood] == [200] * 12, flood[-1].text
        other = client.post("/v1/responses", json={**body, "cache_salt": "other"})
        assert other.status_code == 200, other.text
        assert client.get(f"/v1/responses/{other.json()['id']}?cache_salt=other").status_code \
            == 200
        kept = [client.get(f"/v1/responses/{r.json()['id']}?cache_salt=flood").status_code
                for r in flood]
        # the flooding tenant keeps its newest responses within its share (8 // 4), oldest gone
        assert kept == [404] * 10 + [200] * 2


def test_a_tenant_past_its_share_loses_its_oldest_responses_first(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "s.sqlite3", max_responses=100, max_bytes=1 << 20,
                          tenant_max_responses=3)
    for k in range(5):
        store.put(record(f"a{k}", "a"))
    store.put(record("b0", "b"))
    assert [store.get(f"a{k}", "a") is not None for k in range(5)] == [False, False] + [True] * 3
    assert store.get("b0", "b") is not None
    assert store.usage("a").count == 3 and store.usage().count == 4
    store.close()


def test_a_full_store_makes_room_from_the_tenant_holding_the_most(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "s.sqlite3", max_responses=4, max_bytes=1 << 20,
                          tenant_max_responses=3)
    for k in range(3):
        store.put(record(f"big{k}", "big"))
    store.put(record("small0", "small"))
    store.put(record("small1", "small"))  # the store is full: "big" holds the most
    assert store.get("big0", "big") is None and store.get("big1", "big") is not None
    assert store.get("small0", "small") is not None
    assert len(store) == 4
    store.close()


def test_a_response_larger_than_a_tenants_share_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    store = ResponseStore(tmp_path / "s.sqlite3", max_responses=100, max_bytes=4000)
    store.put(record("small", "a"))
    with pytest.raises(StoreFullError, match="share"):
        store.put(record("huge", "a", tokens=2000))  # > 4000 // 4 bytes
    assert store.get("small", "a") is not None and len(store) == 1
    store.close()


def test_the_counters_are_kept_across_a_restart_and_from_an_older_file(tmp_path: Path) -> None:
    """A file of the schema before the counters (one table, no triggers) is counted once
    when opened; the counts then survive a restart."""
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at "
               "INTEGER NOT NULL, size INTEGER NOT NULL, record BLOB NOT NULL)")
    for k in range(3):
        blob = msgspec.json.encode(record(f"old{k}", "a"))
        db.execute("INSERT INTO responses VALUES (?, ?, 0, ?, ?)", (f"old{k}", "a", len(blob),
                                                                     blob))
    db.commit()
    db.close()
    store = ResponseStore(path, max_responses=100, max_bytes=1 << 20, tenant_max_responses=3)
    assert store.usage("a").count == 3
    store.put(record("new", "a"))  # a's share is full: its oldest goes
    assert store.get("old0", "a") is None and store.get("old1", "a") is not None
    store.close()
    again = ResponseStore(path, max_responses=100, max_bytes=1 << 20, tenant_max_responses=3)
    assert again.usage("a").count == 3 and len(again) == 3
    assert again.usage("a").bytes == sum(
        len(msgspec.json.encode(again.get(i, "a"))) for i in ("old1", "old2", "new")
    )
    again.close()


def test_a_put_reads_counters_rather_than_scanning_the_table(tmp_path: Path) -> None:
    """Issue 60 #11: every put counted the whole table twice (141 ms at 100k rows). The
    work of one put, in SQLite's VM steps, does not grow with the rows stored."""
    store = ResponseStore(tmp_path / "s.sqlite3", max_responses=1 << 30, max_bytes=1 << 40)
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0

    def one_put_steps(k: int) -> int:
        store._db.set_progress_handler(step, 10)
        steps[0] = 0
        store.put(record(f"probe{k}", "t"))
        store._db.set_progress_handler(None, 10)
        return steps[0]

    for k in range(200):
        store.put(record(f"r{k}", f"t{k % 3}"))
    few = one_put_steps(0)
    for k in range(200, 3000):
        store.put(record(f"r{k}", f"t{k % 3}"))
    many = one_put_steps(1)
    assert many <= 2 * few + 20, f"a put took {few} steps at 200 rows and {many} at 3,000"
    store.close()


def test_the_store_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "private" / "responses.sqlite3"
    store = ResponseStore(path, max_responses=10, max_bytes=1 << 20)
    store.put(StoredResponse(id="resp_1", tenant="", created_at=0, history=[], token_ids=[1],
                             body={}))
    for file in path.parent.iterdir():
        mode = stat.S_IMODE(os.stat(file).st_mode)
        assert mode & 0o077 == 0, f"{file.name} is readable by others: {oct(mode)}"
    assert stat.S_IMODE(os.stat(path.parent).st_mode) & 0o077 == 0
    store.close()


@pytest.mark.parametrize("limit", ["max_responses", "max_bytes"])
def test_the_store_holds_its_bounds(tmp_path: Path, limit: str) -> None:
    bounds = {"max_responses": 100, "max_bytes": 1 << 20, limit: 2 if limit == "max_responses"
              else 600}
    store = ResponseStore(tmp_path / "s.sqlite3", **bounds)
    for k in range(4):
        store.put(record(f"b{k}", "t", tokens=20))
    assert store.get("b3", "t") is not None
    assert len(store) <= 2 and store.usage().bytes <= bounds["max_bytes"]
    assert store.delete("b3", "t") and not store.delete("b3", "t")
    store.close()


def record(rid: str, tenant: str, tokens: int = 20) -> StoredResponse:
    return StoredResponse(id=rid, tenant=tenant, created_at=0, history=[],
                          token_ids=[1] * tokens, body={})


class StoreMachine(RuleBasedStateMachine):
    """The store against a model of what it should hold: a tenant reads and deletes only its
    own rows, the bounds (in all and per tenant) always hold, a put that fits a tenant's
    share always succeeds and is kept, a refused put changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.TemporaryDirectory()
        self.store = ResponseStore(Path(self.folder.name) / "s.sqlite3", max_responses=5,
                                   max_bytes=2000, tenant_max_responses=3,
                                   tenant_max_bytes=1200)
        self.ids = 0
        self.live: dict[str, str] = {}  # id -> tenant, of the rows that may still be there

    @rule(tenant=st.sampled_from(["", "a", "b"]), tokens=st.integers(0, 400))
    def put(self, tenant: str, tokens: int) -> None:
        self.ids += 1
        record = StoredResponse(id=f"r{self.ids}", tenant=tenant, created_at=0, history=[],
                                token_ids=[7] * tokens, body={"n": self.ids})
        size = len(msgspec.json.encode(record))
        before = len(self.store)
        try:
            self.store.put(record)
        except StoreFullError:
            assert size > 1200
            assert len(self.store) == before
        else:
            assert size <= 1200
            assert self.store.get(record.id, tenant) is not None
            self.live[record.id] = tenant

    @rule(tenant=st.sampled_from(["", "a", "b"]), pick=st.integers(0, 30))
    def get(self, tenant: str, pick: int) -> None:
        rid = f"r{pick}"
        found = self.store.get(rid, tenant)
        if found is not None:
            assert self.live.get(rid) == tenant

    @rule(tenant=st.sampled_from(["", "a", "b"]), pick=st.integers(0, 30))
    def delete(self, tenant: str, pick: int) -> None:
        rid = f"r{pick}"
        there = self.store.get(rid, tenant) is not None
        assert self.store.delete(rid, tenant) == there
        assert self.store.get(rid, tenant) is None

    @invariant()
    def holds_its_bounds(self) -> None:
        total = self.store.usage()
        assert total.count <= 5 and total.bytes <= 2000
        tenants = [self.store.usage(t) for t in ("", "a", "b")]
        assert all(u.count <= 3 and u.bytes <= 1200 for u in tenants)
        assert sum(u.count for u in tenants) == total.count
        assert sum(u.bytes for u in tenants) == total.bytes

    def teardown(self) -> None:
        self.store.close()
        self.folder.cleanup()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
