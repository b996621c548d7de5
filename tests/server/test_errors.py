"""Bad input over HTTP: every case of the matrix gets a 4xx with OpenAI's error JSON naming
the field, never a traceback, and the server keeps serving."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    """The body as JSON bytes (json.dumps escapes non-ASCII, as many clients do)."""
    content = json.dumps(body).encode()
    return httpx.post(
        url, content=content, headers={"content-type": "application/json"}, timeout=30
    )


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 2, **fields}


# (route, body, status, the param the error names)
MATRIX = [
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=-3), 400, "max_completion_tokens"),
    (CHAT, chat(max_tokens=10_000), 400, "messages"),
    (CHAT, chat(temperature=-0.5), 400, "temperature"),
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    (CHAT, chat(top_k=-2), 400, "top_k"),
    (CHAT, chat(min_p=2), 400, "min_p"),
    (CHAT, chat(seed=-1), 400, "seed"),
    (CHAT, chat(seed=1 << 63), 400, "seed"),  # the engine's seeds are below 2**63
    (CHAT, {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
    (CHAT, chat(n=0), 400, "n"),
    (CHAT, chat(n=1000), 400, "n"),
    (CHAT, chat(stop=[""]), 400, "stop"),
    (CHAT, chat(stop=5), 400, "stop"),
    (CHAT, chat(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    (CHAT, chat(ignore_eos="yes"), 400, "ignore_eos"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(presence_penalty=2.5), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(logit_bias={"five": 10}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={str(10**9): 1}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"\u0661\u0662": 1}), 400, "logit_bias"),  # Arabic-Indic 12
    (CHAT, chat(logit_bias={"\u00b2": 1}), 400, "logit_bias"),  # a superscript 2
    (CHAT, chat(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
    (CHAT, chat(tools=[{"type": "function", "function": {}}]), 400, "tools[0].function.name"),
    (CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools[0].type"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"),
     400, "tool_choice"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                structured_outputs={"regex": "[a-z]+"}), 400, "structured_outputs.regex"),
    (CHAT, chat(tool_choice="none"), 400, "tool_choice"),
    (CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema.schema"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "no-such-type"}}}), 400, "response_format.json_schema.schema"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "no-such-type"}}}]), 400, "tools[0].function.parameters"),
    (CHAT, chat(structured_outputs={"regex": "a("}), 400, "structured_outputs.regex"),
    (CHAT, chat(priority=1 << 40), 400, "priority"),
    (CHAT, chat(priority="high"), 400, "priority"),
    (CHAT, chat(structured_outputs={"regex": "a", "choice": ["b"]}), 400, "structured_outputs"),
    (CHAT, chat(structured_outputs={"grammar": "start: foo"}), 400, "structured_outputs.grammar"),
    (CHAT, chat(structured_outputs={"xml": "<a/>"}), 400, "structured_outputs.xml"),
    (COMPLETIONS, {"prompt": "a", "structured_outputs": {"choice": []}}, 400,
     "structured_outputs.choice"),
    (CHAT, chat(cache_salt="x" * 300), 400, "cache_salt"),
    (CHAT, chat(cache_salt=7), 400, "cache_salt"),
    (CHAT, chat(model="gpt-4o"), 404, "model"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [-1, 5]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -5, "echo": True}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    (CHAT, chat(prompt_logprobs=-1), 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": 9000}, 400, "prompt[0]"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), MATRIX)
def test_bad_input_gets_openai_error_json(
    server_url: str, route: str, body: dict, status: int, param: str
) -> None:
    reply = post(server_url + route, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] is not None and error["param"].startswith(param), error
    assert "Traceback" not in error["message"]
    assert error["code"] is None or isinstance(error["code"], str), error  # as OpenAI's


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'{"messages": [',
        b"\xff\xfe",
        b'{"messages": [{"role": "user", "content": "\xff"}]}',  # a str that is not UTF-8
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    ],
)
def test_unparseable_bodies_get_400(server_url: str, raw: bytes) -> None:
    reply = httpx.post(server_url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "codec" not in reply.json()["error"]["message"]  # ours, not Python's
    assert reply.json()["error"]["code"] is None  # a string or null, never the status


def test_json_nested_too_deeply_is_a_400_not_a_500(server_url: str) -> None:
    # an unknown field is skipped, and msgspec's skipping recurses once per level
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "extra": '
    raw += b"[" * 5000 + b"]" * 5000 + b"}"
    reply = httpx.post(server_url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert "nested too deeply" in reply.json()["error"]["message"]


def test_a_body_over_the_size_limit_is_a_413_before_it_is_parsed(server_url: str) -> None:
    big = {"model": "x", "messages": [{"role": "user", "content": "a" * (5 << 20)}]}
    reply = httpx.post(server_url + CHAT, json=big, timeout=60)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(  # no Content-Length: counted while it streams in
        server_url + CHAT, content=iter([b'{"messages": "'] + [b"a" * (1 << 20)] * 6 + [b'"}']),
        headers={"content-type": "application/json"}, timeout=60,
    )
    assert chunked.status_code == 413


def test_a_text_longer_than_any_context_is_refused_without_holding_the_server(
    server_url: str,
) -> None:
    """3 MB messages (under the body limit) cannot fit 8,192 tokens whatever their tokens:
    refused by their length before tokenizing, while /health keeps answering at once."""
    body = {"messages": [{"role": "user", "content": "word " * (600 << 10)}]}
    health: list[float] = []
    replies: list[httpx.Response] = []

    def probe() -> None:
        for _ in range(10):
            start = time.perf_counter()
            httpx.get(server_url + "/health", timeout=30)
            health.append(time.perf_counter() - start)
            time.sleep(0.05)

    def big() -> None:
        replies.append(httpx.post(server_url + CHAT, json=body, timeout=60))

    workers = [threading.Thread(target=probe)] + [threading.Thread(target=big) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert [r.status_code for r in replies] == [400] * 3
    assert {r.json()["error"]["code"] for r in replies} == {"context_length_exceeded"}
    assert max(health) < 2.0, health


def test_one_request_cannot_add_more_than_the_choices_cap(server_url: str) -> None:
    body = {"prompt": ["Hi"] * 100, "n": 3, "max_tokens": 1}  # 300 engine requests
    reply = httpx.post(server_url + COMPLETIONS, json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"


def test_unknown_routes_and_methods_get_json_errors(server_url: str) -> None:
    missing = httpx.post(server_url + "/v1/embeddings", json={})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "route_not_found"
    wrong = httpx.get(server_url + CHAT)
    assert wrong.status_code == 405 and "error" in wrong.json()
    model = httpx.get(server_url + "/v1/models/nope")
    assert model.status_code == 404 and model.json()["error"]["code"] == "model_not_found"


def test_unknown_fields_are_ignored_as_openai_does(server_url: str) -> None:
    reply = httpx.post(
        server_url + CHAT,
        json=chat(
            temperature=0,
            user="u1",
            parallel_tool_calls=True,
            metadata={"a": "b"},
            some_future_field=[1, 2],
        ),
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "route,nulls",
    [
        (CHAT, ["n", "stream", "logprobs", "top_logprobs", "top_p", "stop", "seed",
                "parallel_tool_calls", "tool_choice", "tools", "response_format", "ignore_eos",
                "return_token_ids", "stream_options", "max_completion_tokens"]),
        (COMPLETIONS, ["n", "stream", "echo", "logprobs", "suffix", "best_of", "top_p",
                       "prompt_logprobs"]),
    ],
)
def test_optional_fields_sent_as_null_are_as_if_not_sent(
    server_url: str, route: str, nulls: list[str]
) -> None:
    """OpenAI's optional fields are "or null"; clients pass their unset options as null."""
    base = chat(temperature=0) if route == CHAT else {"prompt": "hi", "max_tokens": 2,
                                                       "temperature": 0}
    plain = post(server_url + route, base)
    with_nulls = post(server_url + route, {**base, **dict.fromkeys(nulls)})
    assert plain.status_code == with_nulls.status_code == 200, with_nulls.text
    key = "message" if route == CHAT else "text"
    assert [c[key] for c in with_nulls.json()["choices"]] == [
        c[key] for c in plain.json()["choices"]
    ] and len(plain.json()["choices"]) == 1


def test_server_keeps_serving_after_the_error_matrix(server_url: str) -> None:
    for route, body, _, _ in MATRIX:
        post(server_url + route, body)
    assert httpx.get(server_url + "/health").status_code == 200
    reply = httpx.post(server_url + CHAT, json=chat(temperature=0), timeout=60)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("fields", "calling", "named"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, False,
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}}, False, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True, "tools"),
        ({"structured_outputs": {"json": {}}}, False, "structured_outputs.json"),
    ],
)
def test_a_grammar_the_engine_refuses_is_named_by_the_field_it_came_from(
    fields: dict, calling: bool, named: str
) -> None:
    """What the engine still refuses of the grammar a chat request's fields combine into (it
    names it structured_outputs.<kind>) is named by the field the client sent."""
    from server import protocol
    from server.errors import from_engine
    from server.openai import records

    req = protocol.decode_body(json.dumps(chat(**fields)).encode(), records.ChatRequest)
    kind = "json_object" if named == "response_format" else "json"
    refused = ValueError(f"params.structured_outputs.{kind}: too many alternatives")
    error = from_engine(refused, records.structure_renames(req, calling))
    assert error.param == named and error.message == f"{named}: too many alternatives"
