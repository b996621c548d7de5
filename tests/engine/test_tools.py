"""Tool calling in the Python API: calls valid for their schema, and an agent loop whose every
step hits the cache for everything before its new tool result."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest
from engine_helpers import assert_idle_accounting, greedy, user
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import StructuredOutputsParams
from engine.serving.tools.radixkv import (
    SEPARATORS,
    CallScanner,
    calls_text,
    parse_tool_calls,
    scan_calls,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]


def test_required_calls_validate_and_render_back_to_the_same_text(engine) -> None:
    asks = [user(f"What is the weather in {c}?") for c in ("Paris", "Oslo", "Lima")]
    outs = engine.generate(asks, greedy(60), tools=TOOLS, tool_choice="required")
    for out in outs:
        assert out.finish_reason == "tool_calls" and out.tool_calls
        for call in out.tool_calls:
            assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), WEATHER)
        # byte-stable: the history renders the calls as the model wrote them
        assert calls_text([(c.name, c.arguments) for c in out.tool_calls]) == out.text
    assert_idle_accounting(engine)


def test_tool_choice_none_never_parses_a_call(engine) -> None:
    [out] = engine.generate(user("Weather in Paris?"), greedy(20), tools=TOOLS, tool_choice="none")
    assert out.tool_calls is None and out.finish_reason in ("stop", "length")


def test_an_agent_loop_hits_the_cache_for_every_earlier_step(engine) -> None:
    session = engine.chat(system="You are a weather assistant.", params=greedy(60),
                          tools=TOOLS, tool_choice="required", namespace="agent-loop")
    before = 0  # prompt + reply tokens of the previous step
    for step, city in enumerate(("Paris", "Oslo", "Lima", "Rome")):
        if step == 0:
            session.send(f"What is the weather in {city}?")
        else:
            session.send(json.dumps({"city": city, "temperature": 10 + step}), role="tool")
        out = session.last_output
        assert out.tool_calls, out.text
        if step:
            # everything before this step's tool result, in whole pages of 16 tokens (the
            # previous reply's last token was sampled, never fed back: its KV is not stored)
            assert out.cached_tokens >= (before - 1) // 16 * 16, (step, out.cached_tokens, before)
        before = out.prompt_tokens + len(out.token_ids)


def test_tools_need_conversations_and_a_known_named_tool(engine) -> None:
    with pytest.raises(ValueError, match=r"prompts: tools are offered in conversations"):
        engine.generate("plain text", greedy(4), tools=TOOLS)
    with pytest.raises(ValueError, match=r"tool_choice.function.name: 'nope'"):
        engine.generate(user("hi"), greedy(4), tools=TOOLS,
                        tool_choice={"type": "function", "function": {"name": "nope"}})
    assert parse_tool_calls("plain reply") is None
    with pytest.raises(ValueError, match=r"tool_choice: only allowed when tools are given"):
        engine.generate(user("hi"), greedy(4), tool_choice="required")
    with pytest.raises(ValueError, match=r"tool_choice: only allowed when tools are given"):
        engine.chat(tool_choice="required")


def test_a_streamed_chat_turn_yields_its_calls_and_streams_a_tool_result(engine) -> None:
    session = engine.chat(params=greedy(60), tools=TOOLS, tool_choice="required")
    *_, streamed = session.stream("What is the weather in Paris?")
    assert streamed.tool_calls and streamed.finish_reason == "tool_calls"
    assert streamed is session.last_output
    *_, after = session.stream(json.dumps({"city": "Paris", "temperature": 21}), role="tool")
    assert after.tool_calls and session.messages[-2]["role"] == "tool"


ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


def test_a_reply_format_beside_tools_holds_for_the_reply_that_is_not_a_call(engine) -> None:
    """params.structured_outputs beside tools: a call, or a reply in that format."""
    params = msgspec.structs.replace(greedy(60), structured_outputs=StructuredOutputsParams(
        json=ANSWER))
    for choice in ("auto", "none"):
        [out] = engine.generate(user("Weather in Paris?"), params, tools=TOOLS,
                                tool_choice=choice)
        if out.tool_calls:
            assert choice == "auto" and out.finish_reason == "tool_calls"
        else:
            jsonschema.validate(json.loads(out.text), ANSWER)
    regex = msgspec.structs.replace(greedy(4), structured_outputs=StructuredOutputsParams(
        regex="[a-z]+"))
    with pytest.raises(ValueError, match=r"structured_outputs.regex: beside tools"):
        engine.generate(user("hi"), regex, tools=TOOLS)
    assert_idle_accounting(engine)


@settings(max_examples=80, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8),
            st.recursive(
                st.none() | st.integers() | st.text(max_size=6),
                lambda inner: st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                max_leaves=6,
            ).map(lambda v: {"v": v}),
        ),
        min_size=1, max_size=3,
    ),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_a_call_reply_read_in_any_pieces_reads_as_the_whole(calls, cuts) -> None:
    text = calls_text([(name, json.dumps(args, separators=SEPARATORS)) for name, args in calls])
    whole = scan_calls(text)
    assert whole.complete and [(n, json.loads(a)) for n, a, _ in whole.calls] == calls
    scanner = CallScanner()
    at = 0
    for cut in sorted({min(c, len(text)) for c in cuts}) + [len(text)]:
        scan = scanner.feed(text[at:cut])
        at = cut
        for (name, arguments, _), (final_name, final, _) in zip(scan.calls, whole.calls):
            assert name == final_name and final.startswith(arguments)  # append-only
    assert scan == whole
