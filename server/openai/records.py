"""The request records of chat completions, completions and ``/tokenize``/``/detokenize``,
and the checks only those endpoints make (``server.protocol`` holds what the Responses API
shares with them: the sampling fields, messages, decoding a body, the engine's params).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine import StructuredOutputsParams
from engine import tools as tool_format
from server.errors import invalid
from server.protocol import ChatMessage, SamplingFields

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
RESPONSE_SCHEMA = "response_format.json_schema.schema"


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: Any = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # rendered into the conversation as chat renders them


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return list(prompt)
    if isinstance(prompt, list) and not prompt:
        raise invalid("prompt: empty list; expected at least one prompt")
    raise invalid(
        "prompt: expected a string, a list of strings, a list of token ids or a list of "
        f"token-id lists, got {type(prompt).__name__}"
    )


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_chat_only(req: ChatRequest) -> None:
    # The bound of top_logprobs is SamplingParams' (its ``logprobs``).
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs: needs logprobs=true")


def check_completion_only(req: CompletionRequest) -> None:
    if req.suffix:
        raise invalid("suffix: not supported by this server")
    if req.best_of not in (None, req.n):
        raise invalid(
            f"best_of: only best_of == n is supported (no server-side ranking), got "
            f"best_of={req.best_of!r}, n={req.n!r}"
        )
    asked = req.max_tokens
    if asked is not None and (asked < 0 or (asked == 0 and not req.echo)):
        raise invalid(
            f"max_tokens: must be >= 1 (0, to score the prompt only, needs echo=true), got "
            f"{req.max_tokens}",
            param="max_tokens",
        )


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """What the output must match: vLLM's ``structured_outputs`` (both endpoints) or OpenAI's
    ``response_format`` (chat: ``json_object``, ``json_schema``); at most one of them."""
    fmt = getattr(req, "response_format", None)
    kind = None if not fmt else fmt.get("type")
    if kind not in (None, "text", "json_object", "json_schema"):
        raise invalid(
            f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
            param="response_format.type",
        )
    given = req.structured_outputs
    if given and kind not in (None, "text"):
        raise invalid("structured_outputs: give it or response_format, not both")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid(
                "response_format.json_schema.schema: expected a JSON schema object",
                param="response_format.json_schema.schema",
            )
        try:
            tool_format.check_json_schema(schema, RESPONSE_SCHEMA)
        except ValueError as exc:
            raise invalid(str(exc), param=RESPONSE_SCHEMA) from None
        return StructuredOutputsParams(json=schema)
    if not given:
        return None
    unknown = sorted(k for k, v in given.items() if k not in STRUCTURED_KINDS and v is not None)
    if unknown:
        raise invalid(
            f"structured_outputs.{unknown[0]}: not supported; use one of "
            f"{', '.join(STRUCTURED_KINDS)}",
            param=f"structured_outputs.{unknown[0]}",
        )
    try:
        return StructuredOutputsParams(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise invalid(str(exc)) from None


def structure_renames(req: ChatRequest, calling: bool) -> dict[str, str]:
    """The engine names a grammar it refuses ``structured_outputs.<kind>``; a chat request's
    grammar may have come from fields of other names: its ``response_format``, or its
    ``tools`` (``calling``: the tools' constraint, which holds every tool's schema, and the
    reply format beside them). The error names what the client sent."""
    if calling:
        return {f"structured_outputs.{kind}": "tools" for kind in ("json", "grammar")}
    kind = (req.response_format or {}).get("type")
    if kind == "json_schema":
        return {"structured_outputs.json": RESPONSE_SCHEMA}
    if kind == "json_object":
        return {"structured_outputs.json_object": "response_format"}
    return {}
