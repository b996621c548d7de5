"""Request shaping is the engine's, whichever door a request comes in by: the same tools, the
same tool choice and the same truncation give the same prompt and the same parsed calls from
``Engine.generate``, a ``ChatSession`` (sent or streamed) and the chat endpoint (whole or
streamed), over one engine in this process."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from engine import Engine, SamplingParams
from engine.api import ContextLengthError, ToolCall
from engine.serving.tools import NO_TOOLS, ToolUse
from server import create_app

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = "What is the weather in Paris, in celsius?"


@pytest.fixture(scope="module")
def engine(loaded_fp32: Any) -> Any:
    with Engine(model=loaded_fp32, num_pages=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(engine: Engine) -> Any:
    with TestClient(create_app(engine)) as client:
        yield client


def named(calls: list[ToolCall] | None) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls or []]


def streamed_calls(client: TestClient, body: dict[str, Any]) -> tuple[list[tuple[str, str]], str]:
    """The calls a streamed chat response's deltas join to, and its finish reason."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    reason = ""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    k = call["index"]
                    if "name" in call["function"]:
                        names[k] = call["function"]["name"]
                    arguments[k] = arguments.get(k, "") + call["function"]["arguments"]
                reason = choice["finish_reason"] or reason
    return [(names[k], arguments[k]) for k in sorted(names)], reason


def test_every_door_reads_the_same_calls_from_the_same_request(
    engine: Engine, client: TestClient
) -> None:
    params = SamplingParams(max_new_tokens=60, temperature=0.0)
    messages = [{"role": "user", "content": ASK}]
    [generated] = engine.generate([messages], params, tools=TOOLS, tool_choice="required")
    session = engine.chat(params=params, tools=TOOLS, tool_choice="required")
    *deltas, turn = session.stream(ASK)
    assert "".join(d for d in deltas if isinstance(d, str)) == turn.text
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60,
            "temperature": 0}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    over_http = [(c["function"]["name"], c["function"]["arguments"])
                 for c in whole["message"]["tool_calls"]]
    stream_calls, stream_reason = streamed_calls(client, body)

    assert named(generated.tool_calls) and generated.finish_reason == "tool_calls"
    assert named(turn.tool_calls) == named(generated.tool_calls)
    assert turn.finish_reason == "tool_calls" and turn is session.last_output
    assert over_http == named(generated.tool_calls) and whole["finish_reason"] == "tool_calls"
    assert stream_calls == over_http and stream_reason == "tool_calls"


def test_a_streamed_session_turn_names_its_calls_as_its_deltas_would(engine: Engine) -> None:
    """The session's stream reads the reply with the endpoint's reader: a call's id is the
    one a delta carries, and it is the reader's parse of the whole text."""
    tools = ToolUse(TOOLS, "required")
    reader = tools.stream()
    text = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "celsius"}}]}')
    for k in range(0, len(text), 7):
        assert reader.reading(text[k : k + 7])
    [head, *_] = reader.deltas()
    [output] = engine.generate("x", SamplingParams(max_new_tokens=1))
    finished = reader.finish(msgspec.structs.replace(output, text=text))
    [call] = finished.tool_calls
    assert call.id == head["tool_calls"][0]["id"] and finished.finish_reason == "tool_calls"
    assert json.loads(call.arguments) == {"city": "Oslo", "unit": "celsius"}


def test_tool_choice_without_tools_is_refused_in_the_same_words_everywhere(
    engine: Engine, client: TestClient
) -> None:
    with pytest.raises(ValueError, match=NO_TOOLS):
        engine.generate([[{"role": "user", "content": ASK}]], tool_choice="required")
    with pytest.raises(ValueError, match=NO_TOOLS):
        engine.chat(tool_choice="required")
    reply = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": ASK}], "tool_choice": "required"})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == NO_TOOLS


LONG = "One, two, three, four, five, six, seven, eight, nine, ten. " * 4


@pytest.fixture(scope="module")
def small(loaded_fp32: Any) -> Any:
    """An engine whose KV pool (8 pages of 4 tokens) is far below the model's context."""
    with Engine(model=loaded_fp32, page_size=4, num_pages=8) as engine:
        yield engine


def test_truncating_to_minus_one_keeps_what_the_context_holds_in_python_and_over_http(
    small: Engine,
) -> None:
    """-1 keeps ``max_context`` tokens (here the pool's bound, not the model's 8k context)
    whichever door the request comes in by, and leaves no room to generate: both refuse
    the same 33-token prompt."""
    assert small.max_context == 33 < len(small.encode(LONG))
    assert len(small.encode(LONG, truncate_prompt_tokens=-1)) == small.max_context
    with pytest.raises(ContextLengthError) as refused:
        small.generate(LONG, SamplingParams(max_new_tokens=1, truncate_prompt_tokens=-1))
    assert refused.value.prompt_tokens == small.max_context
    with TestClient(create_app(small)) as client:
        reply = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": LONG}], "truncate_prompt_tokens": -1})
    assert reply.status_code == 400
    assert f"the prompt has {small.max_context};" in reply.json()["error"]["message"]


def test_a_truncated_prompt_is_the_same_tokens_in_python_and_over_http(
    engine: Engine, client: TestClient
) -> None:
    messages = [{"role": "user", "content": LONG}]
    kept = engine.encode(messages, truncate_prompt_tokens=12)
    assert kept == engine.encode(messages)[-12:]
    [out] = engine.generate([messages], SamplingParams(max_new_tokens=2, temperature=0.0,
                                                        truncate_prompt_tokens=12))
    reply = client.post("/v1/chat/completions", json={
        "messages": messages, "truncate_prompt_tokens": 12, "max_tokens": 2,
        "temperature": 0, "return_token_ids": True}).json()
    assert reply["prompt_token_ids"] == kept and reply["usage"]["prompt_tokens"] == 12
    assert reply["choices"][0]["token_ids"] == out.token_ids


def test_a_bad_truncation_is_refused_in_the_same_words_in_python_and_over_http(
    engine: Engine, client: TestClient
) -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens: must be") as refused:
        SamplingParams(truncate_prompt_tokens=0)
    reply = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": ASK}], "truncate_prompt_tokens": 0})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == str(refused.value)


def test_the_server_builds_params_from_the_fields_the_client_sent_only() -> None:
    """A field not sent (or sent as null) takes SamplingParams' own default, so the server
    restates none of them; a field sent reaches the params as the client spelled it."""
    from server import protocol
    from server.openai.records import ChatRequest

    bare = protocol.decode_body(b'{"messages": [], "temperature": null}', ChatRequest)
    [params] = protocol.choice_params(bare, 7, None, {}, None)
    assert params == SamplingParams(max_new_tokens=7)
    body = (b'{"messages": [], "temperature": 0, "top_k": -1, "stop": "x", "seed": 5, "n": 2,'
            b' "ignore_eos": true, "logit_bias": {"3": 1.5}}')
    sent = protocol.decode_body(body, ChatRequest)
    first, second = protocol.choice_params(sent, 7, 2, {}, None)
    assert first == SamplingParams(max_new_tokens=7, temperature=0.0, top_k=0, stop=["x"],
                                   seed=5, ignore_eos=True, logit_bias={3: 1.5}, logprobs=2)
    assert second.seed == 6
