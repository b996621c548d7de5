"""Deterministic synthetic request traces for the radix micro-benchmark (no model, no text).

Each request is a prompt and a reply, both 1-D int32 numpy arrays; the replay caches
prompt + reply, as an engine does when a request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 32_000
REPLY_TOKENS = 32


@dataclass(slots=True)
class TraceRequest:
    prompt: np.ndarray
    reply: np.ndarray


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32)


def shared_prefix(seed: int = 0, groups: int = 16, per_group: int = 16) -> list[TraceRequest]:
    """16 groups x 16 requests: a 2,000-token group prefix + 100 unique tokens, shuffled."""
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, 2000) for _ in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    return [
        TraceRequest(np.concatenate([prefixes[g], _tokens(rng, 100)]), _tokens(rng, REPLY_TOKENS))
        for g in order
    ]


def multi_turn_chat(seed: int = 1, conversations: int = 64, turns: int = 8) -> list[TraceRequest]:
    """64 conversations x 8 turns on one 200-token system prompt, randomly interleaved.

    Turn k's prompt is the system prompt and all earlier user turns (150 tokens) and replies
    (100 tokens), then the new user turn.
    """
    rng = np.random.default_rng(seed)
    system = _tokens(rng, 200)
    history = [system for _ in range(conversations)]
    remaining = [turns] * conversations
    out: list[TraceRequest] = []
    while any(remaining):
        live = [c for c in range(conversations) if remaining[c]]
        c = live[int(rng.integers(len(live)))]
        prompt = np.concatenate([history[c], _tokens(rng, 150)])
        reply = _tokens(rng, 100)
        out.append(TraceRequest(prompt, reply))
        history[c] = np.concatenate([prompt, reply])
        remaining[c] -= 1
    return out


def rag(seed: int = 2, documents: int = 200, requests: int = 2000) -> list[TraceRequest]:
    """system(100) + one of 200 1,000-token documents (Zipf 1.1 popularity) + question(50)."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, 100)
    docs = [_tokens(rng, 1000) for _ in range(documents)]
    weights = 1.0 / np.arange(1, documents + 1) ** 1.1
    picks = rng.choice(documents, size=requests, p=weights / weights.sum())
    return [
        TraceRequest(
            np.concatenate([system, docs[d], _tokens(rng, 50)]), _tokens(rng, REPLY_TOKENS)
        )
        for d in picks
    ]


def unique(seed: int = 3, requests: int = 500) -> list[TraceRequest]:
    """500 random 1,000-token prompts: nothing to share."""
    rng = np.random.default_rng(seed)
    return [TraceRequest(_tokens(rng, 1000), _tokens(rng, REPLY_TOKENS)) for _ in range(requests)]


TRACES = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn_chat,
    "rag": rag,
    "unique": unique,
}
