"""What the OpenAI API's request bodies share across endpoints (chat completions,
completions, responses, ``/tokenize``), decoded and checked, and turned into engine inputs;
each endpoint's own record is its folder's (``server.openai.records``,
``server.responses.shapes``).

Bodies are decoded with msgspec into typed records: a wrong type is refused with the path of
the field (``$.messages[0].content``), and fields the server does not know are ignored, as
OpenAI's API does. What the types cannot say and the engine does not check (combinations,
features the engine does not have, the API's own limits) is checked here, naming the field as
the client spelled it. Everything else is the engine's own validation, made once:
``SamplingParams`` checks the sampling fields (ranges, the stop ids' sign, the logprobs
bound) when ``choice_params`` builds it, ``EngineClient.encode`` the prompt, ``submit`` the
stop ids against the vocabulary and the context fit; the server maps those errors to the
request's field names (``server.errors.from_engine``, ``generation.TokenBudget``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from engine import SamplingParams, StructuredOutputsParams
from engine import tools as tool_format
from engine.api import EngineClient
from server.errors import APIError, from_engine, invalid

# Choices one request may ask for (each is a request in the engine; they share the prompt).
MAX_N = 16
# Roles a conversation may hold; "developer" is OpenAI's newer name for "system".
ROLES = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant",
    "tool": "tool",
}


# msgspec's messages: "Expected `int`, got `str` - at `$.max_tokens`".
_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's result answering one of its calls.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields every generation endpoint shares (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    # None (not sent): SamplingParams' own default, as for every sampling field
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    # Lower runs first (vLLM's), in [-1000, 1000]; only with --scheduling-policy priority
    # (else non-zero is a 400); waiting ages it (the scheduler's priority_aging_seconds).
    priority: int | None = None
    # {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": lark} | {"json_object": true}
    structured_outputs: dict[str, Any] | None = None
    return_token_ids: bool = False
    # Each prompt token's log-probability and this many alternatives (vLLM's).
    prompt_logprobs: int | None = None
    # The tenant: requests with different salts never share a cached page.
    cache_salt: str | None = None


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The JSON body as ``kind``; a 400 naming the field on a wrong type or a bad document.
    A top-level field sent as ``null`` is as if not sent: OpenAI's optional fields are
    "or null", and clients pass their unset options through as null."""
    if not body.strip():
        raise invalid("the request body is empty; expected a JSON object")
    try:
        fields = msgspec.json.decode(body)
        if isinstance(fields, dict):
            fields = {k: v for k, v in fields.items() if v is not None}
        return msgspec.convert(fields, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _AT.search(text)
        path = found.group(1) if found else None
        missing = _MISSING.match(text)
        if missing:  # the field that is missing, not the object that lacks it
            path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return _raise(invalid(f"{path or 'body'}: {text}", param=path))
    except msgspec.DecodeError as exc:
        return _raise(invalid(f"the request body is not valid JSON: {exc}"))
    except UnicodeDecodeError as exc:  # a str field whose bytes are not UTF-8
        return _raise(invalid(f"the request body is not valid UTF-8 (byte {exc.start})"))
    except RecursionError:  # msgspec recurses per nesting level: ~1,000 levels end here
        return _raise(invalid("the request body is nested too deeply to be a valid request"))


def _raise(error: APIError) -> Any:
    raise error


# ------------------------------------------------------------------------------ conversations


def conversation(messages: list[ChatMessage], field: str = "messages") -> list[dict[str, Any]]:
    """OpenAI messages -> the engine's: ``{"role", "content"}`` (text parts joined), or an
    assistant turn that called tools, ``{"role": "assistant", "tool_calls": [(name,
    arguments), ...]}``, which the model's tool format writes (``tool_prompt``)."""
    if not messages:
        raise invalid(f"{field}: empty list; expected at least one message")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        role = ROLES.get(message.role)
        if role is None:
            raise invalid(
                f"{where}.role: {message.role!r} is not supported; expected one of "
                f"{sorted(ROLES)}"
            )
        if role == "tool" and not message.tool_call_id:
            raise invalid(f"{where}.tool_call_id: a tool message answers a call; give its id")
        if role == "assistant" and message.tool_calls:
            out.append({"role": role, "tool_calls": _calls(message.tool_calls, where)})
            continue
        out.append({"role": role, "content": _content_text(message, role, where)})
    return out


def tool_prompt(
    engine: EngineClient,
    history: list[dict[str, Any]],
    tools: list[Any] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    reply: StructuredOutputsParams | None = None,
) -> tuple[tool_format.ToolUse | None, tool_format.ToolPrompt]:
    """The conversation the engine renders and what its reply must match, in the engine's
    tool format (``engine.tools.prepare``: the one call of every door; None for the tool use
    when the request sent no tools), its errors as 400s naming the field
    (``tools[i].function.parameters``, ``tool_choice``). Chat, ``/v1/responses`` and
    ``/tokenize`` render with it, so their counts agree."""
    try:
        return tool_format.prepare(
            history, tools or None, tool_choice, parallel_tool_calls, reply, engine.tool_format
        )
    except ValueError as exc:
        raise invalid(str(exc)) from None


def _calls(calls: list[dict[str, Any]], where: str) -> list[tuple[str, str]]:
    """An assistant message's ``tool_calls`` as (name, arguments JSON text) pairs."""
    pairs = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.tool_calls[{j}].function.name: expected a non-empty string")
        if not isinstance(arguments, str):
            raise invalid(f"{where}.tool_calls[{j}].function.arguments: expected a JSON string")
        pairs.append((name, arguments))
    return pairs


def _content_text(message: ChatMessage, role: str, where: str) -> str:
    content = message.content
    if content is None:
        if role == "assistant":
            return ""
        raise invalid(f"{where}.content: missing; a {role} message needs content")
    if isinstance(content, str):
        return content
    if not content:
        raise invalid(f"{where}.content: empty list; expected at least one text part")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise invalid(
                f"{where}.content[{j}].type: {kind!r} is not supported; this model reads "
                "text parts only"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.content[{j}].text: expected a string")
        texts.append(text)
    return "\n".join(texts)


# --------------------------------------------------------------------------------- sampling


def check_unsupported(req: SamplingFields) -> None:
    """Refuse what the engine cannot do rather than silently ignore it."""
    if not 1 <= req.n <= MAX_N:
        raise invalid(f"n: must be an integer in [1, {MAX_N}], got {req.n!r}")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options: only allowed with stream=true")
    if req.prompt_logprobs is not None and req.stream:
        raise invalid("prompt_logprobs: not available with stream=true (as in vLLM)")


def logit_bias(given: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) as the engine's."""
    bias: dict[int, float] = {}
    for key, value in (given or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid(
                f"logit_bias: keys must be token ids (as strings of digits), got {key[:24]!r}",
                param="logit_bias",
            )
        bias[int(key)] = value
    return bias


# The request's fields that are SamplingParams' under the same name, given as sent.
PASSED_AS_SENT = (
    "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "priority",
)


def choice_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    renames: Mapping[str, str],
    structure: StructuredOutputsParams | None,
    prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    """The engine's params for each of ``req.n`` choices. A seed advances per choice, so n
    seeded choices differ from each other and repeat across identical requests; unseeded
    choices share one SamplingParams (frozen), made and checked once. SamplingParams' own
    check is the request's: its ValueError names the field as the request does (``renames``:
    the engine's name -> the request's, e.g. ``max_new_tokens`` -> ``max_tokens``).
    ``structure``: what every choice's output must match (the request's structured outputs,
    or what tools made of it). ``prompt_logprobs``: alternatives per prompt token (None: the
    prompt is not scored)."""
    if req.seed is not None and not 0 <= req.seed < 1 << 63:  # the engine's seed range
        # checked here: the per-choice seeds below wrap, and would hide a seed out of range
        raise invalid(f"seed: must be an integer in [0, 2**63), got {req.seed!r}")
    seeds = [None] if req.seed is None else [(req.seed + j) % (1 << 63) for j in range(req.n)]
    # what the client sent, as it sent it (SamplingParams reads vLLM's spellings: one stop
    # string, top_k -1); a field not sent (or null) takes SamplingParams' own default
    sent: dict[str, Any] = {
        name: getattr(req, name) for name in PASSED_AS_SENT if getattr(req, name) is not None
    }
    if req.logit_bias is not None:
        sent["logit_bias"] = logit_bias(req.logit_bias)
    derived = {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
               "structured_outputs": structure}
    sent.update((name, value) for name, value in derived.items() if value is not None)
    try:
        made = [
            SamplingParams(max_new_tokens=max_tokens, **sent,
                           **({} if seed is None else {"seed": seed}))
            for seed in seeds
        ]
    except ValueError as exc:
        raise from_engine(exc, renames) from None
    return made * req.n if req.seed is None else made
