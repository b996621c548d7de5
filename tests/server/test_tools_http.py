"""Tool calling through the official openai client against a real server process: calls that
validate against their tool's schema, streamed the way OpenAI streams them, and a round trip
whose second step hits the cache for the whole first step."""

from __future__ import annotations

import json
import uuid

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                      "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


def check_calls(message) -> None:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choices_give_valid_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(reply.choices[0].message)
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    check_calls(named.choices[0].message)
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["add"]


def test_auto_gives_a_call_or_a_plain_reply(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
    )
    message = reply.choices[0].message
    if message.tool_calls:
        check_calls(message)
    else:
        assert message.content and not message.content.startswith("{")


def test_streamed_tool_call_deltas_join_to_the_whole_call(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    fragments = 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": None, "arguments": "", "id": None})
                if delta.id:
                    assert call["id"] is None  # the id and the name come once
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
                fragments += bool(delta.function.arguments)
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert reasons[-1] == "tool_calls"
    assert fragments > len(calls)  # the arguments arrive as they are generated, in pieces


def test_a_streamed_plain_reply_under_auto_is_the_whole_reply(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
                  max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    if whole.tool_calls:
        pytest.skip("the model called a tool here")
    stream = client.chat.completions.create(**kwargs, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.content


def test_a_tool_round_trip_hits_the_cache_for_the_whole_first_step(client: openai.OpenAI) -> None:
    salt = uuid.uuid4().hex
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
        temperature=0, extra_body={"cache_salt": salt},
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0,
        extra_body={"cache_salt": salt},
    )
    before = first.usage.prompt_tokens + first.usage.completion_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Everything before the tool result is the first step's prompt and reply: cached in whole
    # pages of 16 tokens (the reply's end-of-turn token and the page tail are recomputed).
    assert cached >= before - 16 - 1, (cached, before)


def test_an_unknown_named_tool_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert caught.value.body["param"] == "tool_choice.function.name"


def test_the_example_agent_loop_runs_and_every_step_hits_the_cache(client: openai.OpenAI) -> None:
    from workloads.http_bench.agent_loop import run_agent

    steps = run_agent(client, MODEL, steps=4, cache_salt=uuid.uuid4().hex)
    assert all(s.calls for s in steps)
    for previous, step in zip(steps, steps[1:]):
        # the previous step's prompt at least (its reply and the results are new to it)
        assert step.cached_tokens >= previous.prompt_tokens // 16 * 16, (previous, step)
