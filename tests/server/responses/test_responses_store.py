"""Stored responses over an engine in this process: a stored conversation stays pinned, so its
next turn hits though other traffic filled the pool between the turns (and misses with pins
off); a full store refuses with a 400 naming ``store``; the store's file is its owner's only;
every page is accounted for at idle."""

from __future__ import annotations

import os
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


def test_a_full_store_refuses_with_a_400_naming_store(loaded_fp32: Any) -> None:
    engine = Engine(model=loaded_fp32, num_pages=64)
    config = ServerConfig(model_name="m", response_store=":memory:", response_store_max=1)
    with engine, TestClient(create_app(engine, config)) as client:
        body = {"input": "Hi.", "max_output_tokens": 2}
        assert client.post("/v1/responses", json=body).status_code == 200
        full = client.post("/v1/responses", json=body)
        assert full.status_code == 400
        assert full.json()["error"]["param"] == "store"
        assert full.json()["error"]["code"] == "response_store_full"
        assert client.post("/v1/responses", json={**body, "store": False}).status_code == 200


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
              else 300}
    store = ResponseStore(tmp_path / "s.sqlite3", **bounds)
    record = {"tenant": "t", "created_at": 0, "history": [], "token_ids": [1] * 20, "body": {}}
    store.put(StoredResponse(id="a", **record))
    with pytest.raises(Exception, match="full"):
        for k in range(3):
            store.put(StoredResponse(id=f"b{k}", **record))
    assert len(store) <= 2
    assert store.delete("a", "t") and not store.delete("a", "t")
    store.close()


class StoreMachine(RuleBasedStateMachine):
    """The store against a dict of what it should hold: a tenant reads and deletes only its
    own rows, the bounds always hold, a refused put changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.TemporaryDirectory()
        self.store = ResponseStore(Path(self.folder.name) / "s.sqlite3", max_responses=5,
                                   max_bytes=2000)
        self.model: dict[str, tuple[str, int]] = {}  # id -> (tenant, size)
        self.ids = 0

    @rule(tenant=st.sampled_from(["", "a", "b"]), tokens=st.integers(0, 120))
    def put(self, tenant: str, tokens: int) -> None:
        self.ids += 1
        record = StoredResponse(id=f"r{self.ids}", tenant=tenant, created_at=0, history=[],
                                token_ids=[7] * tokens, body={"n": self.ids})
        size = len(msgspec.json.encode(record))
        fits = (len(self.model) < 5
                and sum(s for _, s in self.model.values()) + size <= 2000)
        try:
            self.store.put(record)
        except StoreFullError:
            assert not fits
        else:
            assert fits
            self.model[record.id] = (tenant, size)

    @rule(tenant=st.sampled_from(["", "a", "b"]), pick=st.integers(0, 30))
    def get(self, tenant: str, pick: int) -> None:
        rid = f"r{pick}"
        found = self.store.get(rid, tenant)
        owner = self.model.get(rid)
        assert (found is not None) == (owner is not None and owner[0] == tenant)

    @rule(tenant=st.sampled_from(["", "a", "b"]), pick=st.integers(0, 30))
    def delete(self, tenant: str, pick: int) -> None:
        rid = f"r{pick}"
        owner = self.model.get(rid)
        mine = owner is not None and owner[0] == tenant
        assert self.store.delete(rid, tenant) == mine
        if mine:
            del self.model[rid]

    @invariant()
    def holds_what_it_should(self) -> None:
        assert len(self.store) == len(self.model) <= 5

    def teardown(self) -> None:
        self.store.close()
        self.folder.cleanup()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
