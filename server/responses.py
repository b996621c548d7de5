"""The parts of OpenAI's response bodies and stream chunks built from the engine's outputs:
usage and log-probabilities (the SSE framing is ``streaming.sse``)."""

from __future__ import annotations

import math
from typing import Any

from engine import RequestOutput, TokenLogprob
from server.tokens import TokenTexts

# JSON has no -inf: a token the model gives no chance at all gets this floor.
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(outputs_by_prompt: list[list[RequestOutput]]) -> dict[str, Any]:
    """A prompt counts once however many choices ran on it; its cached part is what was
    cached when the first of its choices arrived (the smallest hit among them)."""
    prompt = sum(outs[0].prompt_tokens for outs in outputs_by_prompt)
    cached = sum(min(o.cached_tokens for o in outs) for outs in outputs_by_prompt)
    completion = sum(len(o.token_ids) for outs in outputs_by_prompt for o in outs)
    return usage(prompt, completion, cached)


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion: one entry per token."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": texts.text(token_id),
            "logprob": _lp(logprob),
            "bytes": texts.bytes(token_id),
        }

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    entries: list[TokenLogprob], texts: TokenTexts, offset: int
) -> tuple[dict[str, Any], int]:
    """``choices[i].logprobs`` of a completion (the legacy layout) and the text offset after
    its tokens (a stream continues from there)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        text = texts.text(e.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(e.logprob))
        top.append({texts.text(t): _lp(lp) for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return body, offset
