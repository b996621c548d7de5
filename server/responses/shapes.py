"""The Responses API's shapes: its request record, its input items as the chat messages the
engine renders, its tools and text format as chat's, and the output items and usage of a
response. Only shapes; ``endpoints`` runs the requests.

Input items (``input`` as a string, or a list of items): messages (``role`` and ``content``, a
string or ``input_text``/``output_text`` parts), ``function_call`` (a call the model made,
sent back by the client) and ``function_call_output`` (its result). Consecutive calls become
one assistant turn with ``tool_calls``, as chat has them, so both endpoints render a
conversation alike and hit the same cache.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from engine import StructuredOutputsParams
from engine import tools as tool_format
from engine.api import RequestOutput, ToolCall
from server.errors import APIError, invalid
from server.protocol import SamplingFields

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
TEXT_FORMAT_SCHEMA = "text.format.schema"
# OpenAI's bounds on ``metadata``: the store keeps it with the response, untokenized.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# An item's ``id`` or ``call_id`` is stored and carried into every later turn untokenized.
MAX_ID_CHARS = 256
# ``include`` asking for the reply's log-probabilities (``top_logprobs`` asks too).
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# What an input item keeps once stored (``as_items``): what continuing and listing need.
ITEM_KEYS = {
    "message": ("type", "id", "role", "content", "status"),
    "function_call": ("type", "id", "call_id", "name", "arguments", "status"),
    "function_call_output": ("type", "id", "call_id", "output", "status"),
}


class ResponsesRequest(SamplingFields, kw_only=True):
    """``POST /v1/responses`` (OpenAI's fields, and the sampling extensions chat has)."""

    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    include: list[str] | None = None
    # OpenAI's conversation: its id, or an object with it (``/v1/conversations``); the turn
    # reads its items as the context and appends its input and output to it.
    conversation: Any = None


def check_request(req: ResponsesRequest) -> None:
    """What this server refuses rather than ignores."""
    if conversation_id(req) is not None and req.previous_response_id is not None:
        raise invalid(
            "conversation: give it or previous_response_id, not both",
            param="conversation",
        )
    check_metadata(req.metadata)
    if req.n != 1:
        raise invalid(f"n: a response has one output; got n={req.n}", param="n")
    if req.background:
        raise invalid("background: not supported by this server", param="background")
    if req.truncation not in (None, "disabled"):
        raise invalid(
            f"truncation: only 'disabled' is supported, got {req.truncation!r}",
            param="truncation",
        )
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise invalid("reasoning: this model does not reason; leave it unset", param="reasoning")
    if req.stream_options is not None:
        raise invalid("stream_options: not a field of the Responses API", param="stream_options")


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds on ``metadata`` (16 pairs, keys of 64 characters, values of 512): it
    is stored as it is, so it must not take what the store holds for conversations."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid(f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(metadata)}",
                      param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise invalid(
                f"metadata: keys are at most {MAX_METADATA_KEY_CHARS} characters, got one of "
                f"{len(key)} ({key[:16]!r}...)",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid(
                f"metadata: values are at most {MAX_METADATA_VALUE_CHARS} characters; "
                f"{key!r} has {len(value)}",
                param="metadata",
            )


def wants_logprobs(req: ResponsesRequest) -> int | None:
    """The alternatives per token the reply's log-probabilities carry (None: no
    log-probabilities): ``top_logprobs``, or 0 when only ``include`` asks for them."""
    if req.top_logprobs is not None:
        return req.top_logprobs
    return 0 if INCLUDE_LOGPROBS in (req.include or []) else None


def conversation_id(req: ResponsesRequest) -> str | None:
    """The id ``conversation`` names (a string, or an object with ``id``); a 400 otherwise."""
    given = req.conversation
    if given is None:
        return None
    found = given.get("id") if isinstance(given, dict) else given
    if not isinstance(found, str) or not found:
        raise invalid(
            "conversation: expected a conversation id or an object {\"id\": ...}",
            param="conversation",
        )
    return found


def open_calls(items: list[dict[str, Any]]) -> list[str]:
    """The call ids of a conversation's ``function_call`` items no output answered yet:
    what the next turn's input must answer first."""
    pending: dict[str, None] = {}
    for item in items:
        if item.get("type") == "function_call":
            pending[item.get("call_id", "")] = None
        elif item.get("type") == "function_call_output":
            pending.pop(item.get("call_id", ""), None)
    return list(pending)


def stored_calls(body: dict[str, Any]) -> list[str]:
    """The call ids of a stored response's reply (its ``output``, as the client got them):
    what the next turn's input must answer first."""
    return [item["call_id"] for item in body.get("output", [])
            if item.get("type") == "function_call"]


def check_pairing(
    given: str | list[Any], stored: list[str], source: str = "previous_response_id"
) -> None:
    """Every ``function_call`` answered by its ``function_call_output`` before the next
    message, and every output answering a call made before it (in this input, or the
    stored conversation's open calls, ``stored``), as OpenAI requires: a 400 naming the
    call's ``call_id`` (or ``source``, the field that brought a stored call)."""
    pending = {call_id: source for call_id in stored}
    items = [{"type": "message"}] if isinstance(given, str) else given
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "function_call":
            pending[item["call_id"]] = f"input[{i}].call_id"
        elif kind == "function_call_output":
            call_id = item["call_id"]
            if pending.pop(call_id, None) is None:
                raise invalid(
                    f"input[{i}].call_id: no function_call with call_id {call_id!r} comes "
                    "before this output (in this input or the stored conversation)",
                    param=f"input[{i}].call_id",
                )
        elif pending:
            _unanswered(pending, f"before input[{i}]")
    if pending:
        _unanswered(pending, "in the input")


def _unanswered(pending: dict[str, str], where: str) -> None:
    call_id, field = next(iter(pending.items()))
    raise invalid(
        f"{field}: no function_call_output for the function_call with call_id {call_id!r} "
        f"{where}; send its output (type function_call_output, call_id {call_id!r})",
        param=field,
    )


def longest_field(req: ResponsesRequest, history: list[dict[str, Any]]) -> str:
    """The field holding most of the prompt's text (``instructions``, ``tools`` or the
    conversation, ``input``): what a prompt too long for the context is said to be."""
    sizes = {
        "instructions": len(req.instructions or ""),
        "tools": len(json.dumps(req.tools)) if req.tools else 0,
        "input": sum(len(m.get("content") or "") + len(str(m.get("tool_calls") or ""))
                     for m in history),
    }
    return max(sizes, key=lambda field: sizes[field])


def input_messages(given: str | list[Any], field: str = "input") -> list[dict[str, Any]]:
    """The input items as OpenAI chat messages (``server.protocol.ChatMessage``'s shape)."""
    if isinstance(given, str):
        if not given:
            raise invalid(f"{field}: empty string; expected text or input items", param=field)
        return [{"role": "user", "content": given}]
    if not given:
        raise invalid(f"{field}: empty list; expected at least one input item", param=field)
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where}: expected an object (an input item)", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {
                "id": _id(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _text(item, "name", where),
                    "arguments": _text(item, "arguments", where, empty=True),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _parts_text(output, f"{where}.output")
            messages.append({
                "role": "tool", "content": output,
                "tool_call_id": _id(item, "call_id", where),
            })
        else:
            raise invalid(
                f"{where}.type: {kind!r} is not supported; expected 'message', "
                "'function_call' or 'function_call_output'",
                param=f"{where}.type",
            )
        if item.get("id") is not None:
            _id(item, "id", where)
    return messages


def _id(item: dict[str, Any], key: str, where: str) -> str:
    """An item's ``id`` or ``call_id``: stored and carried forward as it is, so bounded."""
    value = _text(item, key, where)
    if len(value) > MAX_ID_CHARS:
        raise invalid(f"{where}.{key}: at most {MAX_ID_CHARS} characters, got {len(value)}",
                      param=f"{where}.{key}")
    return value


def as_items(given: str | list[Any]) -> list[dict[str, Any]]:
    """The input (checked by ``input_messages`` first) as output-shaped items with ids, as
    ``input_items`` lists them: text becomes a user message of ``input_text``. An item keeps
    only the keys its type has (``ITEM_KEYS``), its text parts only their type and text:
    whatever else a client sends is neither stored nor carried into later turns."""
    entries = [{"role": "user", "content": given}] if isinstance(given, str) else given
    items = []
    for entry in entries:
        kind = entry.get("type", "message")
        item = {k: entry[k] for k in ITEM_KEYS[kind] if entry.get(k) is not None}
        item["type"] = kind
        if item.get("status") not in ("in_progress", "completed", "incomplete"):
            item.pop("status", None)
        if isinstance(item.get("output"), list):
            item["output"] = _parts(item["output"])
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            if isinstance(content, str):
                item["content"] = [{"type": part, "text": content}]
            else:
                item["content"] = _parts(content)
            item.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc"}.get(kind, "fco")
        item.setdefault("id", new_id(prefix))
        items.append(item)
    return items


def _parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text parts (checked by ``_parts_text``) with only their type and text."""
    return [{"type": part["type"], "text": part["text"]} for part in parts]


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise invalid(
            f"{where}.role: {role!r} is not supported; expected one of {list(MESSAGE_ROLES)}",
            param=f"{where}.role",
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
    return {"role": role, "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list) or not parts:
        raise invalid(f"{where}: expected a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise invalid(
                f"{where}[{j}].type: {kind!r} is not supported; this model reads text parts "
                "only (input_text, output_text)",
                param=f"{where}[{j}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}[{j}].text: expected a string", param=f"{where}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _text(item: dict[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise invalid(f"{where}.{key}: expected a non-empty string", param=f"{where}.{key}")
    return value


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools (``{"type": "function", "name", "parameters", ...}``) as
    chat's (``{"type": "function", "function": {...}}``)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(
                f"tools[{i}].type: {kind!r} is not supported; this server runs function tools",
                param=f"tools[{i}].type",
            )
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters")}
        out.append({"type": "function", "function": function})
    return out


def flat_tool_error(error: APIError) -> APIError:
    """A tool error named in chat's shape (``tools[0].function.parameters``) in the Responses
    API's flat one (``tools[0].parameters``)."""
    return APIError(
        error.status, _FUNCTION.sub(r"\1.", error.message), error.type,
        None if error.param is None else _FUNCTION.sub(r"\1.", error.param), error.code,
    )


_FUNCTION = re.compile(r"(tools\[\d+\])\.function\.")


def chat_tool_choice(choice: Any, tools: list[Any] | None) -> Any:
    """Responses' ``{"type": "function", "name": ...}`` as chat's; the strings as they are.
    "none" or "auto" without tools is plain generation, as OpenAI has it (LlamaIndex sends
    it); "required" or a named function without tools stays the engine's 400."""
    if not tools and choice in ("none", "auto"):
        return None
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def text_format(text: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """``text.format``: plain text (None), ``json_object``, or ``json_schema`` (its schema
    checked as chat's ``response_format`` is)."""
    fmt = (text or {}).get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise invalid(f"{TEXT_FORMAT_SCHEMA}: expected a JSON schema object",
                          param=TEXT_FORMAT_SCHEMA)
        try:
            tool_format.check_json_schema(schema, TEXT_FORMAT_SCHEMA)
        except ValueError as exc:
            raise invalid(str(exc), param=TEXT_FORMAT_SCHEMA) from None
        return StructuredOutputsParams(json=schema)
    raise invalid(
        f"text.format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
        param="text.format.type",
    )


# ----------------------------------------------------------------------------- the output


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message", "id": item_id, "status": status, "role": "assistant",
        "content": [] if status == "in_progress" else [text_part(text)],
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` part; ``logprobs`` as OpenAI has them (``token``, ``logprob``,
    ``bytes``, ``top_logprobs``: chat's entries), [] when not asked for."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
        "arguments": call.arguments, "status": status,
    }


def call_status(arguments: str, whole: bool) -> str:
    """A call's status: a reply cut by ``max_output_tokens`` (``whole`` False) leaves only
    its last call unfinished, its arguments not yet a JSON document; the calls before it
    were finished."""
    if whole:
        return "completed"
    try:
        json.loads(arguments)
    except ValueError:
        return "incomplete"
    return "completed"


def output_items(
    output: RequestOutput,
    calls: list[ToolCall],
    whole: bool = True,
    logprobs: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The reply as output items: its calls (one item each; cut by ``max_output_tokens``:
    ``whole`` False, the unfinished one's arguments as far as they got), or one message
    (with ``logprobs``, OpenAI's, when asked for)."""
    if calls:
        return [call_item(new_id("fc"), call, call_status(call.arguments, whole))
                for call in calls]
    item = message_item(new_id("msg"), output.text)
    item["content"] = [text_part(output.text, logprobs)]
    if output.finish_reason == "length":
        item["status"] = "incomplete"
    return [item]


def reply_message(output: RequestOutput, calls: list[ToolCall]) -> dict[str, Any]:
    """The reply as a chat message, for the stored history."""
    if calls:
        return {"role": "assistant", "content": None,
                "tool_calls": [call.to_openai() for call in calls]}
    return {"role": "assistant", "content": output.text}


def usage(output: RequestOutput) -> dict[str, Any]:
    generated = len(output.token_ids)
    return {
        "input_tokens": output.prompt_tokens,
        "input_tokens_details": {"cached_tokens": output.cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": output.prompt_tokens + generated,
    }


def status_of(output: RequestOutput | None) -> tuple[str, dict[str, str] | None]:
    """The response's ``status`` and ``incomplete_details`` for how its request ended."""
    if output is None:
        return "in_progress", None
    if output.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if output.finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    output: RequestOutput | None,
    items: list[dict[str, Any]],
) -> dict[str, Any]:
    """The response object (``output`` None: in progress, as streams begin)."""
    status, incomplete = status_of(output)
    conversation = conversation_id(req)
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "conversation": None if conversation is None else {"id": conversation},
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": items,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_logprobs": req.top_logprobs,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled",
        "usage": None if output is None else usage(output),
        "user": req.user,
        "metadata": req.metadata or {},
    }
