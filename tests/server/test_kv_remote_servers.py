"""Two separate ``radixkv serve`` processes (no Ray) on one Redis server: the second one's
first request over a document the first one has seen hits from the remote tier, answers as
the first did, and another tenant's request on it hits nothing."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.redis_server import redis_server
from tests.server_process import ServerProcess

openai = pytest.importorskip("openai")

DOCUMENT = " ".join(
    f"Section {i}: shipments to depot {i % 7} leave on weekday {i % 5} at {8 + i % 9} am."
    for i in range(36)
)


def _written_remote(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r'^radixkv:kv_tier_pages_written_total\{[^}]*tier="remote"[^}]*\} (\S+)$',
                      text, re.M)
    return float(found.group(1)) if found else 0.0


def _settled(url: str, timeout: float = 20.0) -> float:
    """The remote writes are asynchronous: wait until the count stops moving."""
    deadline, last = time.monotonic() + timeout, -1.0
    while time.monotonic() < deadline:
        now = _written_remote(url)
        if now == last and now > 0:
            return now
        last = now
        time.sleep(0.5)
    raise AssertionError(f"remote writes did not settle: {last}")


def test_a_second_server_hits_what_the_first_computed_and_answers_the_same(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path) as (redis_url, _):
        flags = ("--kv-remote", redis_url, "--num-pages", "128")
        first = ServerProcess(*flags)
        second = ServerProcess(*flags)
        try:
            clients = [
                openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
                for s in (first, second)
            ]

            def ask(client: object, question: str, salt: str | None = None) -> object:
                return client.chat.completions.create(  # type: ignore[attr-defined]
                    model="SmolLM2-135M-Instruct",
                    messages=[{"role": "user", "content": f"{DOCUMENT}\n\n{question}"}],
                    max_tokens=6, temperature=0,
                    extra_body={"cache_salt": salt} if salt else None,
                )

            seen = ask(clients[0], "When do shipments to depot 3 leave?")
            assert seen.usage.prompt_tokens_details.cached_tokens == 0
            assert _settled(first.url) * 16 >= seen.usage.prompt_tokens - 32
            stranger = ask(clients[1], "When do shipments to depot 3 leave?", salt="tenant-b")
            assert stranger.usage.prompt_tokens_details.cached_tokens == 0
            again = ask(clients[1], "When do shipments to depot 3 leave?")
            assert again.choices[0].message.content == seen.choices[0].message.content
            cached = again.usage.prompt_tokens_details.cached_tokens
            assert cached >= seen.usage.prompt_tokens - 32, (cached, seen.usage)
            metrics = httpx.get(second.url + "/metrics", timeout=10).text
            assert re.search(r'cached_tokens_total\{[^}]*cache_source="remote"[^}]*\} [1-9]',
                             metrics), metrics[-3000:]
        finally:
            for server in (first, second):
                assert server.stop(timeout=60) == 0, server.output()[-3000:]
