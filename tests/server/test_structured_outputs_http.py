"""Structured outputs through the official openai client against a real server process:
response_format (json_schema, json_object) and vLLM's structured_outputs (regex, choice,
grammar), on chat and completions, streamed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_json_schema_replies_validate(client: openai.OpenAI, sampling: dict) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=80, response_format=schema_format(PERSON),
        n=2, **sampling,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_json_schema_deltas_join_to_a_valid_object(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=80, temperature=0,
        response_format=schema_format(PERSON), stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_mode_parses(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Give me a JSON object with one key, 'colour'."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=80, temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_regex_choice_and_grammar_match(client: openai.OpenAI) -> None:
    phone = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}},
    )
    assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text)
    yes_no = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5,
        temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert yes_no.choices[0].message.content in ("yes", "no")
    grammar = 'start: "Result: " /[0-9]+/'
    lark = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=8,
        temperature=0, extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"Result: [0-9]+", lark.choices[0].message.content)


def test_a_grammar_that_cannot_compile_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )
    assert caught.value.body["param"] == "structured_outputs.regex"


@pytest.mark.parametrize("with_tools", [False, True])
def test_a_response_format_schema_that_cannot_compile_is_a_400_naming_response_format(
    client: openai.OpenAI, with_tools: bool
) -> None:
    """Named as the client sent it (it said structured_outputs.json, our internal name),
    alone and beside tools (where it becomes part of one grammar)."""
    extra = {}
    if with_tools:
        extra["tools"] = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8,
            response_format=schema_format({"type": "no-such-type"}), **extra,
        )
    error = caught.value.body
    assert error["param"] == "response_format.json_schema.schema", error
    assert error["message"].startswith("response_format.json_schema.schema: "), error
    assert "structured_outputs" not in error["message"]
    assert error["code"] is None or isinstance(error["code"], str)
