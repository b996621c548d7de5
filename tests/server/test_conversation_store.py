"""The conversation store against a model of it (a hypothesis state machine): items in
order per conversation, tenants apart, each tenant's counters equal to what it holds and
its bounds refusing only its own writes."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from server.conversations.store import (
    Conversation,
    ConversationStore,
    ConversationStoreFull,
)
from server.responses.store import MEMORY

TENANTS = ["", "a"]


class ConversationStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = ConversationStore(MEMORY, max_conversations=3, max_bytes=600)
        self.model: dict[str, tuple[str, list[dict[str, str]]]] = {}  # id -> tenant, items
        self.ids = itertools.count()

    def _items(self, n: int, size: int) -> list[dict[str, str]]:
        return [{"id": f"msg_{next(self.ids)}", "type": "message", "text": "x" * size}
                for _ in range(n)]

    def _bytes(self, tenant: str) -> int:
        return sum(len(self.store._encode(item)) for t, items in self.model.values()
                   if t == tenant for item in items)

    @rule(tenant=st.sampled_from(TENANTS), n=st.integers(0, 3), size=st.integers(0, 120))
    def create(self, tenant: str, n: int, size: int) -> None:
        conversation = Conversation(f"conv_{next(self.ids)}", 0, {})
        items = self._items(n, size)
        count = sum(1 for t, _ in self.model.values() if t == tenant)
        added = sum(len(self.store._encode(item)) for item in items)
        try:
            self.store.create(conversation, tenant, items)
        except ConversationStoreFull:
            assert count >= 3 or self._bytes(tenant) + added > 600
            return
        assert count < 3 and self._bytes(tenant) + added <= 600
        self.model[conversation.id] = (tenant, items)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 3), size=st.integers(0, 120),
          as_other=st.booleans())
    def add(self, data: st.DataObject, n: int, size: int, as_other: bool) -> None:
        conversation_id = data.draw(st.sampled_from(sorted(self.model)))
        tenant, items = self.model[conversation_id]
        caller = "b" if as_other else tenant
        new = self._items(n, size)
        added = sum(len(self.store._encode(item)) for item in new)
        try:
            ok = self.store.add_items(conversation_id, caller, new)
        except ConversationStoreFull:
            assert not as_other and self._bytes(tenant) + added > 600
            return
        assert ok is not as_other
        if ok:
            items.extend(new)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), as_other=st.booleans())
    def delete_item(self, data: st.DataObject, as_other: bool) -> None:
        conversation_id = data.draw(st.sampled_from(sorted(self.model)))
        tenant, items = self.model[conversation_id]
        if not items:
            return
        victim = data.draw(st.sampled_from(items))
        caller = "b" if as_other else tenant
        assert self.store.delete_item(conversation_id, caller, victim["id"]) is not as_other
        if not as_other:
            items.remove(victim)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), as_other=st.booleans())
    def delete(self, data: st.DataObject, as_other: bool) -> None:
        conversation_id = data.draw(st.sampled_from(sorted(self.model)))
        tenant, _ = self.model[conversation_id]
        caller = "b" if as_other else tenant
        assert self.store.delete(conversation_id, caller) is not as_other
        if not as_other:
            del self.model[conversation_id]

    @invariant()
    def every_conversation_holds_its_items_in_order_for_its_tenant_only(self) -> None:
        for conversation_id, (tenant, items) in self.model.items():
            assert self.store.items(conversation_id, tenant) == items
            assert self.store.items(conversation_id, "b") is None
            page = self.store.page(conversation_id, tenant, "desc", None, 2)
            assert page == (items[::-1][:2], len(items) > 2)

    @invariant()
    def each_tenants_counters_equal_what_it_holds(self) -> None:
        for tenant in TENANTS:
            count = sum(1 for t, _ in self.model.values() if t == tenant)
            with self.store._lock:
                assert self.store._usage(tenant) == (count, self._bytes(tenant))

    def teardown(self) -> None:
        self.store.close()


TestConversationStoreMachine = ConversationStoreMachine.TestCase
TestConversationStoreMachine.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None
)
