"""What a finished request hands back to its caller."""

from __future__ import annotations

import msgspec

from engine.model.sampler import TokenLogprob
from engine.serving.tools import ToolCall


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
