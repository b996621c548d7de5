"""The bodies of chat completions and completions and their stream chunks, built from the
engine's outputs: the envelope around the choices, usage and log-probabilities (the SSE
framing is ``server.streaming.sse``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.api import RequestOutput, TokenLogprob
from server.openai.records import ChatRequest, CompletionRequest
from server.tokens import TokenTexts

if TYPE_CHECKING:
    from server.state import ServerState

# JSON has no -inf: a token the model gives no chance at all gets this floor.
LOGPROB_FLOOR = -9999.0
# envelope(usage=NO_USAGE) leaves the key out (chunks of a stream without include_usage).
NO_USAGE = object()


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
    entries: Sequence[TokenLogprob | None],
    texts: TokenTexts,
    offset: int,
    token_ids: Sequence[int] | None = None,
    top_n: int | None = None,
) -> tuple[dict[str, Any], int]:
    """``choices[i].logprobs`` of a completion (the legacy layout) and the text offset after
    its tokens (a stream continues from there). ``token_ids``: each entry's token, for a
    prompt's entries (its first, which nothing predicts, is None: null log-probabilities, as
    OpenAI's echo gives them); ``top_n``: how many alternatives to show (default: all)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for i, e in enumerate(entries):
        text = texts.text(e.token_id if token_ids is None or e is not None else token_ids[i])
        tokens.append(text)
        token_logprobs.append(None if e is None else _lp(e.logprob))
        shown = None if e is None else e.top[:top_n]
        top.append(None if shown is None else {texts.text(t): _lp(lp) for t, lp in shown})
        offsets.append(offset)
        offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return body, offset


def vllm_prompt_logprobs(
    entries: Sequence[TokenLogprob | None], texts: TokenTexts, top_n: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), the token's and its
    ``top_n`` best alternatives' log-probability, rank and text, by token id."""

    def entry(token_id: int, logprob: float, rank: int) -> tuple[str, dict[str, Any]]:
        return str(token_id), {
            "logprob": _lp(logprob), "rank": rank, "decoded_token": texts.text(token_id)
        }

    return [
        None if e is None else dict([
            entry(e.token_id, e.logprob, e.rank),
            *(entry(t, lp, k + 1) for k, (t, lp) in enumerate(e.top[:top_n])),
        ])
        for e in entries
    ]


def envelope(
    state: ServerState, rid: str, obj: str, created: int, items: list[dict[str, Any]], usage: Any
) -> dict[str, Any]:
    """A response or stream chunk around its choices; ``usage`` NO_USAGE leaves it out."""
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": state.config.model_name,
        "choices": items,
    }
    if usage is not NO_USAGE:
        body["usage"] = usage
    return body


def stream_usage(req: ChatRequest | CompletionRequest) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(req.stream_options and req.stream_options.include_usage)
