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
from engine.api import ToolCall
from engine.serving.tool_use import NO_TOOLS, ToolUse
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
