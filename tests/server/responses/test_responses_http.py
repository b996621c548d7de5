"""``/v1/responses`` through the official ``openai`` client against a real ``radixkv serve``:
every field of the Responses API this server takes, streamed and not; stored conversations
continued by ``previous_response_id`` (answering as chat does with the whole conversation sent,
and hitting the cache), read and deleted, per tenant; a restarted server keeps them and, with a
disk tier, their pages; errors name the field."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from responses_cases import GREEDY, WEATHER
from server_process import ServerProcess


def test_a_response_carries_its_text_usage_and_id_and_can_be_read_back(client) -> None:
    made = client.responses.create(
        model="SmolLM2-135M-Instruct", input="Name a fruit.", max_output_tokens=8, **GREEDY
    )
    assert made.id.startswith("resp_") and made.object == "response"
    assert made.output_text and made.output[0].type == "message"
    assert made.usage.output_tokens == 8 and made.status == "incomplete"
    assert made.incomplete_details.reason == "max_output_tokens"
    assert made.usage.input_tokens > 0
    assert made.usage.input_tokens_details.cached_tokens >= 0
    again = client.responses.retrieve(made.id)
    assert again.id == made.id and again.output_text == made.output_text


def test_a_continued_response_answers_as_chat_does_with_the_whole_conversation(client) -> None:
    first = client.responses.create(
        input=[{"role": "user", "content": "Say one word about the sea."}],
        instructions="Answer briefly.", max_output_tokens=10, **GREEDY,
    )
    second = client.responses.create(
        input="Now one word about the sky.", previous_response_id=first.id,
        instructions="Answer briefly.", max_output_tokens=10, **GREEDY,
    )
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Say one word about the sea."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Now one word about the sky."},
        ],
        max_tokens=10, **GREEDY,
    )
    assert second.output_text == chat.choices[0].message.content
    # the whole first turn (prompt and reply, as the engine ran them) was found in the cache
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= (first.usage.input_tokens + first.usage.output_tokens) // 16 * 16 - 16
    assert second.previous_response_id == first.id


def test_the_stream_is_the_responses_event_stream_and_equals_the_whole_response(client) -> None:
    asked = {"input": "Write one sentence about rain.", "max_output_tokens": 12, **GREEDY}
    whole = client.responses.create(**asked)
    events = list(client.responses.create(stream=True, **asked))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text
    assert client.responses.retrieve(final.id).output_text == deltas  # streams are stored too


def test_a_function_call_and_its_output_continue_the_conversation(client) -> None:
    call_turn = client.responses.create(
        input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=40, **GREEDY,
    )
    [call] = [item for item in call_turn.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    answer = client.responses.create(
        previous_response_id=call_turn.id, tools=[WEATHER], max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 24 C"}],
        **GREEDY,
    )
    assert answer.output_text and answer.output[0].type == "message"
    assert answer.usage.input_tokens_details.cached_tokens > 0


def test_streamed_call_arguments_join_to_the_final_arguments(client) -> None:
    events = list(client.responses.create(
        input="What is the weather in Oslo?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40, stream=True, **GREEDY,
    ))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and added[0].item.type == "function_call"
    pieces = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments and json.loads(done.arguments) == {"city": "Oslo"}
    assert events[-1].type == "response.completed"


def test_text_format_json_schema_constrains_the_reply(client) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    made = client.responses.create(
        input="Pick a colour.", max_output_tokens=30, **GREEDY,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}},
    )
    assert json.loads(made.output_text)["colour"] in ("red", "green", "blue")


def test_one_tenant_can_never_read_continue_or_delete_anothers_response(client) -> None:
    made = client.responses.create(
        input="A secret note.", max_output_tokens=4, extra_body={"cache_salt": "tenant-a"}
    )
    for salt in (None, "tenant-b"):
        query = {} if salt is None else {"cache_salt": salt}
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id, extra_query=query)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(made.id, extra_query=query)
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(
                input="Go on.", previous_response_id=made.id, max_output_tokens=4,
                extra_body={} if salt is None else {"cache_salt": salt},
            )
        assert caught.value.body["param"] == "previous_response_id"
    mine = client.responses.retrieve(made.id, extra_query={"cache_salt": "tenant-a"})
    assert mine.output_text == made.output_text


def test_input_items_list_the_conversation_before_the_response(client) -> None:
    first = client.responses.create(input="Name a river.", max_output_tokens=4, **GREEDY)
    second = client.responses.create(
        input=[{"role": "user", "content": "And a lake?"}], previous_response_id=first.id,
        max_output_tokens=4, **GREEDY,
    )
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [item.type for item in items] == ["message", "message", "message"]
    assert [item.role for item in items] == ["user", "assistant", "user"]
    assert items[0].content[0].text == "Name a river."
    assert items[1].id == first.output[0].id
    assert items[2].content[0].text == "And a lake?"
    newest = client.responses.input_items.list(second.id, limit=1)  # desc by default
    assert [item.id for item in newest.data] == [items[2].id] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=5, after=items[2].id)
    assert [item.id for item in rest.data] == [items[1].id, items[0].id]


def test_a_deleted_response_is_gone_and_cannot_be_continued(client) -> None:
    made = client.responses.create(input="Hello.", max_output_tokens=4)
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(input="Again.", previous_response_id=made.id)
    assert caught.value.body["code"] == "previous_response_not_found"


def test_a_response_with_store_false_is_not_kept(client) -> None:
    made = client.responses.create(input="Hello.", max_output_tokens=4, store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 3}]},
         "tools[0].parameters"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": "hi", "n": 2}, "n"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "priority": "high"}, "priority"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "temperature": -1}, "temperature"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body=body, cast_to=object)
    assert caught.value.body["param"] == param, caught.value.body


def test_stored_responses_and_their_pins_show_in_metrics(server, client) -> None:
    client.responses.create(input="Count to three.", max_output_tokens=6)
    text = httpx.get(server.url + "/metrics").text
    pins = [line for line in text.splitlines() if line.startswith("radixkv:kv_pins{")]
    assert pins and float(pins[0].split()[-1]) >= 1


def test_a_restarted_server_keeps_its_conversations_and_their_pages_on_disk(
    tmp_path: Path,
) -> None:
    args = (
        "--num-pages", "64", "--response-store", str(tmp_path / "responses.sqlite3"),
        "--kv-disk-dir", str(tmp_path / "kv"),
    )
    first_server = ServerProcess(*args)
    try:
        api = openai.OpenAI(base_url=first_server.url + "/v1", api_key="x", max_retries=0)
        first = api.responses.create(
            input="Tell me about lighthouses in two sentences.", max_output_tokens=24, **GREEDY
        )
    finally:
        assert first_server.stop() == 0
    second_server = ServerProcess(*args)
    try:
        api = openai.OpenAI(base_url=second_server.url + "/v1", api_key="x", max_retries=0)
        assert api.responses.retrieve(first.id).output_text == first.output_text
        follow = api.responses.create(
            input="And about harbours?", previous_response_id=first.id, max_output_tokens=8,
            **GREEDY,
        )
        assert follow.usage.input_tokens_details.cached_tokens >= 32, follow.usage
    finally:
        second_server.stop()
