"""What a finished request hands back to its caller."""

from __future__ import annotations

import msgspec


class RequestOutput(msgspec.Struct, frozen=True):
    """The result of one request.

    ``token_ids`` holds the generated tokens only (a stop token that ended the request is
    included; its text is not). ``text`` is their text, cut before the first stop string.
    ``cached_tokens`` counts the prompt tokens served from the prefix cache when the request
    was first admitted. ``ttft_s`` is None when no token was generated (aborted early).
    """

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    latency_s: float
