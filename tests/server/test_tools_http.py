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


ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
ANSWER_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


def test_tools_beside_a_response_format_give_a_call_or_an_answer_in_that_format(
    client: openai.OpenAI,
) -> None:
    """An agent with tools and a typed final answer (the Agents SDK sends both): never plain
    text. tool_choice "none" leaves the answer's format alone."""
    for choice in ("auto", "none"):
        message = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60,
            temperature=0, response_format=ANSWER_FORMAT,
        ).choices[0].message
        if message.tool_calls:
            assert choice == "auto"
            check_calls(message)
        else:
            jsonschema.validate(json.loads(message.content), ANSWER)


def test_allowed_tools_narrow_the_calls_to_the_tools_named(client: openai.OpenAI) -> None:
    message = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        parallel_tool_calls=False,
        tool_choice={"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "add"}}]}},
    ).choices[0].message
    check_calls(message)
    assert {call.function.name for call in message.tool_calls} == {"add"}


@pytest.mark.parametrize(
    "tool_choice,param",
    [
        ({"type": "function", "function": "add"}, "tool_choice.function.name"),
        (["add"], "tool_choice"),
        ({"type": "custom"}, "tool_choice.type"),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}},
         "tool_choice.allowed_tools.mode"),
    ],
)
def test_a_malformed_tool_choice_is_a_400_naming_the_field(
    client: openai.OpenAI, tool_choice: object, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, tool_choice=tool_choice,
        )
    assert caught.value.body["param"] == param


def test_tool_choice_without_tools_and_a_tool_message_without_its_call_id_are_400s(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                       tool_choice="auto")
    assert caught.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, max_tokens=8, tools=TOOLS,
            messages=[*ASK, {"role": "tool", "content": '{"temperature": 18}'}],
        )
    assert caught.value.body["param"] == "messages[1].tool_call_id"


def streamed(client: openai.OpenAI, **kwargs: object) -> tuple[str, dict[int, list[str]], int,
                                                               str | None]:
    """A streamed reply's content, each call's name and argument fragments, its logprob
    entries and its finish reason."""
    content, calls, logprobs, reason = "", {}, 0, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        logprobs += len(choice.logprobs.content or []) if choice.logprobs else 0
        reason = choice.finish_reason or reason
    return content, calls, logprobs, reason


@pytest.mark.parametrize("max_tokens", [3, 20], ids=["before-a-name", "inside-the-arguments"])
def test_a_reply_cut_short_streams_what_the_whole_reply_holds(
    client: openai.OpenAI, max_tokens: int
) -> None:
    """Cut before it can tell it is a call, the text is the content; cut inside a call, the
    call as far as it got (OpenAI: finish_reason "length"); streamed or not, the same, and the
    stream carries a logprob for every token."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=max_tokens, temperature=0,
                  logprobs=True, logit_bias={"107": 100})  # "{": the reply opens like a call
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, logprobs, reason = streamed(client, **kwargs)
    assert whole.finish_reason == reason == "length"
    assert logprobs == len(whole.logprobs.content) == max_tokens
    if whole.message.tool_calls:
        assert max_tokens == 20 and content == "" and whole.message.content is None
        assert {i: [c.function.name, c.function.arguments]
                for i, c in enumerate(whole.message.tool_calls)} == calls
    else:
        assert max_tokens == 3 and content == whole.message.content and content.startswith("{")
        assert calls == {}


def test_tokenize_counts_the_tools_as_the_chat_request_does(
    client: openai.OpenAI, server_url: str
) -> None:
    """Agent frameworks count a conversation's tokens before sending it: with tools, the
    count must be the chat request's own (it ignored them: 82 tokens where chat said 210)."""
    import httpx

    counted = httpx.post(
        server_url + "/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=60
    ).json()
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert counted["count"] == reply.usage.prompt_tokens
    without = httpx.post(server_url + "/tokenize", json={"messages": ASK}, timeout=60).json()
    assert without["count"] < counted["count"]


@pytest.mark.parametrize("bad", [{"type": "no-such-type"}, {"$ref": "#/$defs/missing"}])
def test_a_tool_schema_that_cannot_compile_is_a_400_naming_that_tools_parameters(
    client: openai.OpenAI, bad: dict
) -> None:
    """Named as the client sent it, not by the engine's internal structured_outputs."""
    broken = {"type": "object", "properties": {"x": bad}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": broken}}]
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=ASK, tools=tools, tool_choice=choice, max_tokens=4
            )
        error = caught.value.body
        assert error["param"] == "tools[1].function.parameters", error
        assert error["message"].startswith("tools[1].function.parameters: "), error
        assert "structured_outputs" not in error["message"]
