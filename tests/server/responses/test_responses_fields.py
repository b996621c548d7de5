"""Every field ``/v1/responses`` takes is honoured or refused with a 400 naming it, through the
official ``openai`` client against a real ``radixkv serve`` (issue 60 #3, #7, #8, #13):
``top_logprobs`` come back as OpenAI shapes them, ``structured_outputs`` is checked and
honoured as chat does, ``truncate_prompt_tokens``, ``prompt_logprobs`` and
``return_token_ids`` as chat has them (``conversation``: tests/server/test_conversations_http.py);
``tool_choice`` "none" or
"auto" without tools is plain generation; calls and their outputs must pair; an overlong
field is named; ``metadata`` within OpenAI's limits; only what a conversation needs is
stored and carried into its later turns."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest
from responses_cases import GREEDY, WEATHER


def post(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    """The raw JSON of ``POST /v1/responses`` (the vLLM fields the typed client drops)."""
    return client.post("/responses", body=body, cast_to=object)


def refused(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        post(client, body)
    return caught.value.body


# ------------------------------------------------------------------------------ #7: fields


def test_top_logprobs_come_back_on_the_output_text_as_openai_shapes_them(client) -> None:
    made = client.responses.create(
        input="Name a colour.", max_output_tokens=5, top_logprobs=2,
        include=["message.output_text.logprobs"], **GREEDY,
    )
    [part] = made.output[0].content
    assert len(part.logprobs) == made.usage.output_tokens == 5
    assert "".join(lp.token for lp in part.logprobs) == part.text
    for lp in part.logprobs:
        assert lp.logprob <= 0 and bytes(lp.bytes).decode("utf-8", "replace")
        assert len(lp.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert math.isclose(lp.top_logprobs[0].logprob, lp.logprob, abs_tol=1e-4)
    events = list(client.responses.create(
        input="Name a colour.", max_output_tokens=5, top_logprobs=2, stream=True,
        include=["message.output_text.logprobs"], **GREEDY,
    ))
    streamed = [lp for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert len(events[-1].response.output[0].content[0].logprobs) == 5


def test_structured_outputs_are_checked_and_honoured_as_chat_does(client) -> None:
    bad = {"structured_outputs": {"regex": "("}}
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4, extra_body=bad,
        )
    error = refused(client, {"input": "Hi", "max_output_tokens": 4, **bad})
    assert error["param"] == chat.value.body["param"] == "structured_outputs.regex"
    made = post(client, {
        "input": "Is water wet?", "max_output_tokens": 4, **GREEDY,
        "structured_outputs": {"choice": ["yes", "no"]},
    })
    assert made["output"][0]["content"][0]["text"] in ("yes", "no")
    both = refused(client, {"input": "Hi", "max_output_tokens": 2,
                            "structured_outputs": {"choice": ["a"]},
                            "text": {"format": {"type": "json_object"}}})
    assert both["param"] == "structured_outputs"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client) -> None:
    made = post(client, {"input": "Tell me a long story about a red fox in a wood.",
                         "max_output_tokens": 2, "truncate_prompt_tokens": 6})
    assert made["usage"]["input_tokens"] == 6


def test_prompt_logprobs_and_token_ids_come_back_as_chat_gives_them(client) -> None:
    made = post(client, {"input": "Name a colour.", "max_output_tokens": 3,
                         "prompt_logprobs": 1, "return_token_ids": True, **GREEDY})
    prompt = made["usage"]["input_tokens"]
    assert len(made["prompt_token_ids"]) == prompt and len(made["token_ids"]) == 3
    scores = made["prompt_logprobs"]
    assert len(scores) == prompt and scores[0] is None
    assert str(made["prompt_token_ids"][1]) in scores[1]
    chat = client.post("/chat/completions", cast_to=object, body={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3,
        "prompt_logprobs": 1, "return_token_ids": True, **GREEDY,
    })
    assert chat["prompt_token_ids"] == made["prompt_token_ids"]
    assert chat["choices"][0]["token_ids"] == made["token_ids"]


# ------------------------------------------------------------------ #8: tool_choice alone


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_tool_choice_none_or_auto_without_tools_is_plain_generation(client, choice) -> None:
    made = client.responses.create(input="Say hello.", tool_choice=choice, max_output_tokens=4)
    assert made.output[0].type == "message" and made.output_text
    assert made.tool_choice == choice


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_tool_choice_that_needs_tools_without_tools_is_a_400(client, choice) -> None:
    error = refused(client, {"input": "Hi", "tool_choice": choice, "max_output_tokens": 2})
    assert error["param"] == "tool_choice"


# ---------------------------------------------------------- #13: pairing, lengths, statuses


def test_a_function_call_output_without_its_call_is_a_400_naming_its_call_id(client) -> None:
    error = refused(client, {"max_output_tokens": 2, "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call_output", "call_id": "call_nowhere", "output": "Sunny"},
    ]})
    assert error["param"] == "input[1].call_id" and "call_nowhere" in error["message"]


def test_a_function_call_left_without_its_output_is_a_400_naming_it(client) -> None:
    error = refused(client, {"tools": [WEATHER], "max_output_tokens": 2, "input": [
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": "call_rome", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"role": "user", "content": "Well?"},
    ]})
    assert error["param"] == "input[1].call_id" and "call_rome" in error["message"]


def test_a_stored_call_left_without_its_output_is_a_400(client) -> None:
    call_turn = client.responses.create(
        input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=40, **GREEDY,
    )
    [call] = [item for item in call_turn.output if item.type == "function_call"]
    error = refused(client, {"previous_response_id": call_turn.id, "tools": [WEATHER],
                             "input": "Never mind; say hi.", "max_output_tokens": 2})
    assert error["param"] == "previous_response_id" and call.call_id in error["message"]


@pytest.mark.parametrize("field", ["instructions", "tools", "input"])
def test_an_overlong_field_is_a_400_naming_that_field(client, field) -> None:
    long = "word " * 40_000  # more tokens than the model's context
    body: dict[str, Any] = {"input": "Hi", "max_output_tokens": 4}
    if field == "instructions":
        body["instructions"] = long
    elif field == "tools":
        body["tools"] = [{**WEATHER, "description": long}]
    else:
        body["input"] = long
    error = refused(client, body)
    assert error["param"] == field, error


def test_a_reply_cut_by_the_token_limit_marks_only_its_unfinished_call_incomplete(
    server, client
) -> None:
    two_calls = [  # an earlier turn with two calls: the model makes two again
        {"role": "user", "content": "Weather in Paris and in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "Rain"},
        {"role": "assistant", "content": "Paris is sunny and Oslo is rainy."},
        {"role": "user", "content": "Weather in Rome and in Madrid?"},
    ]
    asked = {"input": two_calls, "tools": [WEATHER], "tool_choice": "required", **GREEDY}
    whole = post(client, {**asked, "max_output_tokens": 120, "return_token_ids": True})
    assert len(whole["output"]) >= 2, whole["output"]
    key = '"arguments": '
    cut = len(whole["token_ids"])
    while cut > 1:  # the longest reply that ends inside the last call's arguments
        cut -= 1
        text = httpx.post(server.url + "/detokenize",
                          json={"tokens": whole["token_ids"][:cut]}).json()["prompt"]
        rest = text[text.rfind(key) + len(key):]
        last = whole["output"][-1]["arguments"]
        if text.count(key) == len(whole["output"]) and rest and last.startswith(rest) and (
            rest != last
        ):
            break
    for stream in (False, True):
        if stream:
            events = list(client.responses.create(stream=True, max_output_tokens=cut, **asked))
            output = [item.model_dump() for item in events[-1].response.output]
        else:
            output = post(client, {**asked, "max_output_tokens": cut})["output"]
        statuses = [item["status"] for item in output]
        assert statuses == ["completed"] * (len(output) - 1) + ["incomplete"], (stream, output)
        for item in output[:-1]:
            json.loads(item["arguments"])


# ------------------------------------------------------- #3: what the store keeps, metadata


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
    ],
)
def test_metadata_past_openais_limits_is_a_400_naming_metadata(client, metadata) -> None:
    error = refused(client, {"input": "Hi", "max_output_tokens": 1, "metadata": metadata})
    assert error["param"] == "metadata"


def test_metadata_within_the_limits_comes_back(client) -> None:
    metadata = {f"k{i}": "v" * 512 for i in range(16)}
    made = client.responses.create(input="Hi", max_output_tokens=1, metadata=metadata)
    assert made.metadata == metadata == client.responses.retrieve(made.id).metadata


def test_keys_an_input_item_does_not_need_are_neither_stored_nor_carried_forward(
    client,
) -> None:
    junk = "x" * 50_000
    first = post(client, {"max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi", "junk": junk}],
         "junk": junk, "type": "message"},
    ]})
    second = client.responses.create(input="And?", previous_response_id=first["id"],
                                     max_output_tokens=2)
    for rid in (first["id"], second.id):
        page = client.get(f"/responses/{rid}/input_items", cast_to=object)
        text = json.dumps(page)
        assert "junk" not in text and len(text) < 5_000, text[:300]
