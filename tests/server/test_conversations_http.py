"""``/v1/conversations`` through the real ``openai`` client against a real server: the whole
lifecycle as OpenAI has it, per tenant, bad items a 400 naming the item, and the Agents SDK's
``OpenAIConversationsSession`` running unchanged on it."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import httpx
import pytest
from server_process import ServerProcess

openai = pytest.importorskip("openai")


def test_a_conversation_is_created_listed_updated_and_deleted_as_openai_does(client) -> None:
    created = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hello there"}],
        metadata={"topic": "greetings"},
    )
    assert created.id.startswith("conv_") and created.metadata == {"topic": "greetings"}
    assert client.conversations.retrieve(created.id).created_at == created.created_at
    updated = client.conversations.update(created.id, metadata={"topic": "weather"})
    assert updated.metadata == {"topic": "weather"}

    added = client.conversations.items.create(created.id, items=[
        {"type": "message", "role": "assistant", "content": "Hi! How can I help?"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Rain?"}]},
    ])
    assert [item.role for item in added.data] == ["assistant", "user"]
    listed = client.conversations.items.list(created.id, order="asc")
    texts = [item.content[0].text for item in listed.data]
    assert texts == ["Hello there", "Hi! How can I help?", "Rain?"]
    assert [item.content[0].type for item in listed.data] == [
        "input_text", "output_text", "input_text",
    ]
    newest = client.conversations.items.list(created.id, limit=1)  # desc by default
    assert newest.data[0].id == listed.data[-1].id and newest.has_more
    after = client.conversations.items.list(created.id, order="asc", after=listed.data[0].id)
    assert [item.id for item in after.data] == [item.id for item in listed.data[1:]]
    one = client.conversations.items.retrieve(listed.data[1].id, conversation_id=created.id)
    assert one.id == listed.data[1].id

    left = client.conversations.items.delete(listed.data[1].id, conversation_id=created.id)
    assert left.id == created.id
    remaining = client.conversations.items.list(created.id, order="asc").data
    assert [item.id for item in remaining] == [listed.data[0].id, listed.data[2].id]
    deleted = client.conversations.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(created.id)


def test_another_tenant_never_finds_a_conversation(client) -> None:
    salt = uuid.uuid4().hex
    mine = client.conversations.create(
        items=[{"role": "user", "content": "my secret plan"}], extra_body={"cache_salt": salt}
    )
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(mine.id)  # no salt: another tenant
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(mine.id, extra_query={"cache_salt": "other"})
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.create(
            mine.id, items=[{"role": "user", "content": "x"}], extra_body={"cache_salt": "o"}
        )
    with pytest.raises(openai.NotFoundError):
        client.conversations.delete(mine.id)
    items = client.conversations.items.list(mine.id, extra_query={"cache_salt": salt}).data
    assert [item.content[0].text for item in items] == ["my secret plan"]
    client.conversations.delete(mine.id, extra_query={"cache_salt": salt})


def test_bad_items_and_metadata_are_a_400_naming_the_field(client) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.conversations.create(items=[{"type": "message", "role": "wizard", "content": "x"}])
    assert bad.value.body["param"] == "items[0].role"
    with pytest.raises(openai.BadRequestError) as bad:
        client.conversations.create(items=[{"role": "user", "content": "x"}] * 21)
    assert bad.value.body["param"] == "items"
    with pytest.raises(openai.BadRequestError) as bad:
        client.conversations.create(metadata={f"k{i}": "v" for i in range(17)})
    assert bad.value.body["param"] == "metadata"
    conversation = client.conversations.create()
    with pytest.raises(openai.BadRequestError) as bad:
        client.conversations.items.list(conversation.id, after="msg_nothing")
    assert bad.value.body["param"] == "after"
    with pytest.raises(openai.BadRequestError) as bad:
        client.conversations.items.create(conversation.id, items=[])
    assert bad.value.body["param"] == "items"


def test_the_agents_sdks_conversation_session_runs_unchanged(server: ServerProcess) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model="SmolLM2-135M-Instruct", openai_client=client)
    agent = agents.Agent(
        name="helper", instructions="Answer in one short sentence.", model=model,
        model_settings=agents.ModelSettings(temperature=0.0, max_tokens=200),
    )

    async def run() -> tuple[list[object], object]:
        session = agents.OpenAIConversationsSession(openai_client=client)
        await agents.Runner.run(agent, "My name is Ada. What is a prime number?",
                                session=session)
        second = await agents.Runner.run(agent, "What is my name?", session=session)
        items = await session.get_items()
        popped = await session.pop_item()
        after_pop = await session.get_items()
        await session.clear_session()
        return [items, popped, after_pop], second

    (items, popped, after_pop), second = asyncio.run(run())
    users = [item["content"] for item in items if item.get("role") == "user"]
    texts = [c if isinstance(c, str) else c[0]["text"] for c in users]
    assert texts == ["My name is Ada. What is a prime number?", "What is my name?"]
    assert len(items) == 4  # two questions, two answers, in order
    assert items[-1]["role"] == "assistant" and popped["id"] == items[-1]["id"]
    assert len(after_pop) == 3
    # the second turn's prompt carried the first turn (the session's history)
    [response] = second.raw_responses
    assert response.usage.input_tokens > 30


def test_a_turn_on_a_conversation_reads_its_items_appends_its_own_and_hits_the_cache(
    client,
) -> None:
    conversation = client.conversations.create(
        items=[{"role": "user", "content": "My name is Ada and I collect old maps of Lisbon."}]
    )
    first = client.responses.create(
        model="SmolLM2-135M-Instruct", input="What is my name?", conversation=conversation.id,
        max_output_tokens=8, temperature=0,
    )
    assert first.conversation is not None and first.conversation.id == conversation.id
    # the same turn with the conversation sent whole: the same greedy answer
    whole = client.responses.create(
        model="SmolLM2-135M-Instruct", store=False, max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "My name is Ada and I collect old maps of Lisbon."},
               {"role": "user", "content": "What is my name?"}],
    )
    assert first.output_text == whole.output_text
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [item.role for item in items] == ["user", "user", "assistant"]
    assert items[-1].content[0].text == first.output_text
    second = client.responses.create(
        model="SmolLM2-135M-Instruct", input="And my hobby?", conversation={"id": conversation.id},
        max_output_tokens=8, temperature=0,
    )
    # the first turn's token ids were kept: its prompt and reply are in the cache
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 16, second.usage
    assert len(client.conversations.items.list(conversation.id).data) == 5


def test_a_turn_on_a_missing_or_foreign_conversation_is_refused_naming_it(client) -> None:
    salt = uuid.uuid4().hex
    theirs = client.conversations.create(items=[], extra_body={"cache_salt": salt})
    for conversation, kind in (("conv_missing", openai.NotFoundError),
                               (theirs.id, openai.NotFoundError)):
        with pytest.raises(kind) as refused:
            client.responses.create(model="SmolLM2-135M-Instruct", input="hi",
                                    conversation=conversation, max_output_tokens=2)
        assert refused.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="SmolLM2-135M-Instruct", input="hi",
                                conversation=theirs.id, previous_response_id="resp_x",
                                max_output_tokens=2, extra_body={"cache_salt": salt})
    assert refused.value.body["param"] == "conversation"


def test_a_conversation_deleted_while_its_turn_runs_costs_the_client_no_answer(client) -> None:
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hi."}])
    stream = client.responses.create(
        model="SmolLM2-135M-Instruct", input="Count from one to fifty in words.",
        conversation=conversation.id, max_output_tokens=48, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    final = None
    for event in stream:
        if event.type == "response.output_text.delta" and final is None:
            client.conversations.delete(conversation.id)
            final = False
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final and final.output_text and final.usage.output_tokens == 48
    assert final.conversation is None  # answered, but kept nowhere


def _pins(server: ServerProcess) -> int:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return int(float(re.search(r"^radixkv:kv_pins\{[^}]*\} (\S+)$", text, re.M).group(1)))


def test_deleting_a_stored_turn_or_a_conversation_ends_its_pin(server, client) -> None:
    salt = uuid.uuid4().hex
    stored = client.responses.create(
        model="SmolLM2-135M-Instruct", input="Tell me about maps of Lisbon.",
        max_output_tokens=6, temperature=0, extra_body={"cache_salt": salt},
    )
    conversation = client.conversations.create(items=[], extra_body={"cache_salt": salt})
    client.responses.create(
        model="SmolLM2-135M-Instruct", input="And of Porto?", conversation=conversation.id,
        max_output_tokens=6, temperature=0, extra_body={"cache_salt": salt},
    )
    before = _pins(server)
    client.responses.delete(stored.id, extra_query={"cache_salt": salt})
    client.conversations.delete(conversation.id, extra_query={"cache_salt": salt})
    deadline = time.monotonic() + 10
    while _pins(server) > before - 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pins(server) == before - 2  # both pins ended now, not at their TTL
