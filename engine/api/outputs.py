"""What a request hands back to its caller: its output, the log-probabilities of its tokens
and the tool calls its reply made. Records only, so a front end (or a replica's caller) reads
them without loading the model."""

from __future__ import annotations

from typing import Any

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True):
    """The log-probability of a generated token under the model, and its best alternatives.

    Log-probabilities are of the model's own distribution (log-softmax of the raw logits),
    before temperature and filters, so they mean the same for every request (vLLM's default).
    ``top`` holds ``(token_id, logprob)`` of the most likely tokens, best first; ``rank`` is
    the token's place among them all (1: none is more likely; vLLM's rank).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int = 1


class ToolCall(msgspec.Struct, frozen=True):
    """One call the model made: ``arguments`` is the JSON text of the arguments, as OpenAI's
    ``function.arguments`` carries it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class RequestOutput(msgspec.Struct, frozen=True):
    """The result of one request.

    ``token_ids`` holds the generated tokens only (a stop token that ended the request is
    included; its text is not). ``text`` is their text, cut before the first stop string.
    ``cached_tokens`` counts the prompt tokens served from the prefix cache when the request
    was first admitted. ``ttft_s`` is None when no token was generated (aborted early);
    ``queue_s`` (arrival to first admission) is None when it never ran. ``itl_s`` holds the
    gaps between successive generated tokens. ``logprobs``: one per generated token when the
    request's params asked for them (``SamplingParams.logprobs``), else None.
    ``prompt_logprobs``: one per prompt token when asked (``SamplingParams.prompt_logprobs``),
    None for the first (nothing predicts it), as vLLM gives them.
    """

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    latency_s: float
    queue_s: float | None = None
    itl_s: list[float] = []
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The calls the reply made, when the request offered tools (finish_reason "tool_calls").
    tool_calls: list[ToolCall] | None = None
