"""Shared helpers of the engine API tests (prompts, params, the idle page check)."""

from __future__ import annotations

from typing import Any

from engine import Engine, SamplingParams

# Five-plus chat prompts whose greedy replies are compared token for token with transformers.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Tell me a joke about computers.",
]

ENGINE_PAGES = 256  # 4,096 tokens of KV at page size 16: ~190 MB in float32


def greedy(max_new_tokens: int = 12, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def under_long_system_prompt(tokenizer: Any) -> tuple[list[Any], list[list[int]]]:
    """Four chats under one ~400-token system prompt (a prefix their decodes share), and
    their token ids as the chat template renders them."""
    system = " ".join(
        f"Rule {i}: answer politely, cite the source, and keep each reply short." for i in range(28)
    )
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": p}]
        for p in CHAT_PROMPTS[:4]
    ]
    ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for c in conversations
    ]
    return conversations, ids


def assert_idle_accounting(eng: Engine) -> None:
    """At idle every page is free or held by the prefix tree: nothing leaked."""
    assert eng.wait_idle(timeout=60), "engine did not become idle"
    stats = eng.stats()
    assert stats.requests_running == 0 and stats.requests_waiting == 0
    assert stats.pages.private == 0
    assert stats.pages.free + stats.pages.cached == stats.pages.total
