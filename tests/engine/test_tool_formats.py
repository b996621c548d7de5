"""Native tool formats: a model's format is chosen by its chat template; the Hermes / Qwen
format (``<tool_call>`` blocks, tools written by the template) renders, constrains and parses
its own calls, streams them, and keeps an agent's history byte-stable, on a random Qwen3
checkpoint whose template is of that form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, SamplingParams
from engine.serving.conversation import encode_conversation
from engine.serving.tools import (
    HERMES,
    LLAMA_JSON,
    RADIXKV,
    CallStream,
    ToolUse,
    tool_format_for,
)
from workloads.checkpoints.families import build

# A Hermes-style chat template of our own (ChatML turns; the tools in the system turn inside
# <tools></tools>; a tool's result as a <tool_response> in a user turn), the form Qwen2.5 /
# Qwen3 / Hermes templates take.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these tools, whose signatures are inside <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call one, write its name and arguments as a JSON object inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <tool name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Llama 3.1-style template of our own: the tools and the one-object call format in the first
# user turn; a tool's result in an ipython turn.
LLAMA_TEMPLATE = (
    "{%- for message in messages %}"
    "{% if loop.first and tools %}<|im_start|>user\nGiven these functions, answer with a JSON "
    'object for a call, in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'tool' or message.role == 'ipython' %}<|im_start|>ipython\n"
    "{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}},
}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 checkpoint whose chat template is of Hermes' form."""
    path = tmp_path_factory.mktemp("qwen3-hermes")
    build("qwen3", path)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def qwen_engine(qwen_dir: Path) -> Any:
    with Engine(model=str(qwen_dir), dtype="float32", num_pages=256) as eng:
        yield eng


def test_the_format_follows_the_chat_template(qwen_engine: Engine, engine: Engine) -> None:
    assert qwen_engine.tool_format is HERMES
    assert engine.tool_format is RADIXKV  # the bundled SmolLM2's template knows no tools
    assert tool_format_for(None) is RADIXKV
    assert tool_format_for(LLAMA_TEMPLATE) is LLAMA_JSON


def test_llama_json_calls_round_trip_and_a_forced_one_fits_its_schema(
    tmp_path: Path, qwen_dir: Path
) -> None:
    text = LLAMA_JSON.render_calls([("get_time", '{"zone": "UTC"}')])
    assert text == '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    [call] = LLAMA_JSON.parse(text) or []
    assert (call.name, call.arguments) == ("get_time", '{"zone": "UTC"}')
    assert LLAMA_JSON.parse(text[:-3]) is None and LLAMA_JSON.cut(text[:-3])[0].name == "get_time"
    assert LLAMA_JSON.parse("It is noon.") is None
    import shutil

    shutil.copytree(qwen_dir, tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text(LLAMA_TEMPLATE)
    with Engine(model=str(tmp_path / "m"), dtype="float32", num_pages=64) as eng:
        assert eng.tool_format is LLAMA_JSON
        [out] = eng.generate([{"role": "user", "content": "Time in Paris?"}],
                             SamplingParams(max_new_tokens=40, temperature=0.0),
                             tools=[WEATHER, TIME], tool_choice="required")
    assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1
    assert out.text.startswith('{"name": ')
    args = json.loads(out.tool_calls[0].arguments)
    assert out.tool_calls[0].name in ("get_weather", "get_time") and isinstance(args, dict)


def test_the_template_writes_the_tools_and_the_history_renders_as_generated(
    qwen_engine: Engine,
) -> None:
    """The prompt is the template's own rendering with ``tools=``; an earlier call comes back
    as the block the model wrote, a tool's result as the template's <tool_response>."""
    tok = qwen_engine.tokenizer
    use = ToolUse([WEATHER, TIME], "auto", tool_format=HERMES)
    args = '{"city": "Oslo", "days": 2}'
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [("get_weather", args)]},
        {"role": "tool", "content": "sunny"},
    ]
    prompt = use.prepare(history)
    plain = [*history[:2], {"role": "assistant", "content": HERMES.render_calls(
        [("get_weather", args)])}, history[3]]
    want = tok.apply_chat_template(plain, tools=[WEATHER, TIME], tokenize=False,
                                   add_generation_prompt=True)
    assert "<tools>" in want and '"get_weather"' in want and "<tool_response>" in want
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>' in want
    ids = encode_conversation(tok, prompt.messages, "messages")
    assert tok.decode(ids, skip_special_tokens=False) == want


def test_render_parse_and_cut_round_trip() -> None:
    calls = [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", '{"zone": "UTC"}')]
    text = HERMES.render_calls(calls)
    parsed = HERMES.parse(text)
    assert parsed is not None and [(c.name, c.arguments) for c in parsed] == calls
    assert HERMES.parse(text + "\nand more") is None  # not only calls: a plain reply
    assert HERMES.parse("The weather is fine.") is None
    cut = HERMES.cut(text[:-25])
    assert [c.name for c in cut] == ["get_weather", "get_time"]
    assert cut[1].arguments == calls[1][1][: len(cut[1].arguments)]
    assert HERMES.may_be_call("<tool") and HERMES.may_be_call(text)
    assert not HERMES.may_be_call("Sure")


def test_a_streamed_call_sends_deltas_that_join_to_the_final_arguments() -> None:
    text = HERMES.render_calls([("get_weather", '{"city": "Oslo", "days": 2}'),
                                ("get_time", '{"zone": "CET"}')])
    stream = CallStream(HERMES)
    deltas: list[dict[str, Any]] = []
    for i in range(0, len(text), 3):
        assert stream.reading(text[i : i + 3])
        deltas += stream.deltas()
    joined: dict[int, str] = {}
    names = {}
    for d in deltas:
        for call in d["tool_calls"]:
            joined[call["index"]] = joined.get(call["index"], "") + call["function"]["arguments"]
            if "name" in call["function"]:
                names[call["index"]] = call["function"]["name"]
    assert names == {0: "get_weather", 1: "get_time"}
    assert joined == {0: '{"city": "Oslo", "days": 2}', 1: '{"zone": "CET"}'}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_a_forced_call_is_a_valid_call_of_an_offered_tool(qwen_engine: Engine, choice: Any) -> None:
    """Constrained by the format's grammar, even a random model writes well-formed blocks
    whose arguments fit the tool's schema."""
    [out] = qwen_engine.generate(
        [{"role": "user", "content": "What is the weather?"}],
        SamplingParams(max_new_tokens=80, temperature=0.0),
        tools=[WEATHER, TIME], tool_choice=choice,
    )
    assert out.finish_reason == "tool_calls" and out.tool_calls
    assert out.text.startswith("<tool_call>\n")
    for call in out.tool_calls:
        args = json.loads(call.arguments)
        if call.name == "get_weather":
            assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7
        else:
            assert call.name == "get_time" and args["zone"] in ("UTC", "CET")
    if isinstance(choice, dict):
        assert [c.name for c in out.tool_calls] == ["get_time"]


def test_an_agent_session_keeps_its_history_byte_stable(qwen_engine: Engine) -> None:
    """A chat session with tools: the call, the tool's result, the answer; each turn's
    prompt begins with the last turn's prompt and reply tokens, so it hits the cache."""
    session = qwen_engine.chat(tools=[WEATHER], tool_choice="required",
                               params=SamplingParams(max_new_tokens=60, temperature=0.0))
    session.send("Weather in Oslo for two days?")
    first = session.last_output
    assert first is not None and first.tool_calls
    session.send("sunny, 20 C", role="tool")
    second = session.last_output
    assert second is not None and session.last_dropped_tokens == 0
    assert second.cached_tokens >= first.prompt_tokens + len(first.token_ids) - 16


def test_an_agent_loop_through_the_openai_client_over_http(qwen_dir: Path) -> None:
    """The plumbing over HTTP with the real openai client and a real server process serving
    the Qwen-format model: a forced call (whole and streamed: the deltas join to the final
    arguments), the tool's result sent back, then a plain answer (answers are a random
    model's; the calls, ids and history are what is checked)."""
    import openai

    from tests.server_process import ServerProcess

    proc = ServerProcess("--model", str(qwen_dir), "--num-pages", "256")
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
        first = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], tool_choice="required",
            max_tokens=60, temperature=0,
        )
        call = first.choices[0].message.tool_calls[0]
        assert first.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert set(json.loads(call.function.arguments)) == {"city", "days"}
        chunks = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], tool_choice="required",
            max_tokens=60, temperature=0, stream=True,
        )
        streamed = ""
        for chunk in chunks:
            for delta in chunk.choices[0].delta.tool_calls or []:
                streamed += delta.function.arguments or ""
        assert streamed == call.function.arguments
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 20 C"},
        ]
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], tool_choice="none",
            max_tokens=8, temperature=0,
        )
        assert answer.choices[0].message.tool_calls is None
        assert answer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    finally:
        proc.stop()
