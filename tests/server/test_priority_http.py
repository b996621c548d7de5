"""vLLM's ``priority`` over HTTP: refused (400 naming ``priority``, OpenAI's error JSON) unless
the server was started with ``--scheduling-policy priority``; then it orders admission within
[-1000, 1000] and never changes a greedy answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"


def chat(url: str, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def assert_refused(reply: httpx.Response, *words: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "priority" and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"]


@pytest.fixture(scope="module")
def priority_url() -> Iterator[str]:
    proc = ServerProcess("--num-pages", "256", "--scheduling-policy", "priority")
    yield proc.url
    proc.stop()


def test_a_priority_is_refused_unless_the_server_schedules_by_priority(server_url: str) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "store": False}),
    ):
        reply = httpx.post(server_url + path, json={**body, "priority": -1000}, timeout=120)
        assert_refused(reply, "--scheduling-policy priority")
    assert chat(server_url, priority=0).status_code == 200
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"priority": 5},
        )
    assert refused.value.body["param"] == "priority"  # type: ignore[index]


def test_a_request_with_a_priority_answers_as_one_without(priority_url: str) -> None:
    """vLLM's ``priority`` (lower first) orders admission; it never changes a greedy answer."""
    answers = []
    for extra in ({}, {"priority": -1000}, {"priority": 7}, {"priority": 1000}):
        reply = chat(priority_url, **extra)
        assert reply.status_code == 200, reply.text
        answers.append(reply.json()["choices"][0]["message"]["content"])
    assert len(set(answers)) == 1


def test_a_priority_outside_the_range_names_it_and_the_range(priority_url: str) -> None:
    for bad in (1001, -1001, 1 << 40):
        assert_refused(chat(priority_url, priority=bad), "[-1000, 1000]")
