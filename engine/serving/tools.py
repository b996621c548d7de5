"""Tool calling for a model without a tool format of its own: one fixed, documented format.

The tools are written into the system turn as JSON, one per line, after a fixed instruction;
a call is the model's whole reply, a compact JSON object ``{"tool_calls": [{"name": ...,
"arguments": {...}}]}``, which structured outputs force to be valid for the tool's
``parameters`` schema (``required`` or a named tool: a call and nothing else; ``auto``: a call
or a plain reply that does not start with ``{``, or one in the request's own format, e.g. the
JSON schema of an agent's final answer). Everything is rendered byte-stable (fixed
separators, arguments kept as the text the model generated), so an agent's step k+1 prompt
begins with step k's prompt and reply and hits the cache. This is ``tool_use.RADIXKV``, the
one ``ToolFormat``; a model family with its own format plugs in there as another.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from engine.api.outputs import ToolCall
from engine.model.structured import JSON_LAYOUT, with_json_layout
from scheduler import StructuredOutputsParams

INSTRUCTION = (
    "You can call functions. The functions you can call, one JSON object per line:\n"
    "{tools}\n"
    'To call functions, reply with only a JSON object: {{"tool_calls": [{{"name": '
    '"<function name>", "arguments": {{<arguments>}}}}]}}. Otherwise reply in plain text.'
)
SEPARATORS = (", ", ": ")  # what the constrained JSON is generated with, and rendered with
CHOICES = ("none", "auto", "required")


def check_tools(tools: Any, field: str = "tools") -> list[dict[str, Any]]:
    """OpenAI's ``tools`` as a list of functions ``{"name", "description", "parameters"}``."""
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise ValueError(f"{field}: expected a non-empty list of tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{where}.function: expected an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name: expected a non-empty string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise ValueError(f"{where}.function.parameters: expected a JSON schema object")
        check_json_schema(dict(parameters), f"{where}.function.parameters")
        entry = {"name": name, "parameters": dict(parameters)}
        if function.get("description"):
            entry["description"] = str(function["description"])
        functions.append(entry)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: function names must be unique, got {names}")
    return functions


def check_json_schema(schema: dict[str, Any], field: str) -> None:
    """A ValueError naming ``field`` when ``schema`` cannot compile (an unknown type, a bad
    ``$ref``). Each schema the client sent is checked alone, before it is combined with
    others (the tools' call, a reply format): the combined grammar's error could only name
    the whole, under a field the client never sent. No tokenizer is needed for this, so a
    front end without the engine can check too."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(with_json_layout(schema))
        error = LLMatcher.validate_grammar(grammar, None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{field}: {exc}") from None
    if error and not error.startswith("WARNING"):
        raise ValueError(f"{field}: cannot compile: {error.strip().splitlines()[0]}")


def tools_text(functions: list[dict[str, Any]]) -> str:
    """The system turn's tool section (byte-stable: keys sorted, fixed separators)."""
    lines = "\n".join(
        json.dumps(f, sort_keys=True, separators=SEPARATORS, ensure_ascii=False)
        for f in functions
    )
    return INSTRUCTION.format(tools=lines)


def with_tools(messages: list[dict[str, str]], functions: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation with the tool section at the end of its system turn (one is added
    first when it has none)."""
    section = tools_text(functions)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{section}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def tool_constraint(
    functions: list[dict[str, Any]],
    choice: Any,
    parallel: bool = True,
    field: str = "tool_choice",
    reply: StructuredOutputsParams | None = None,
) -> StructuredOutputsParams | None:
    """What the reply must match: a call (``required``, a named function), a call or a plain
    reply (``auto``), or a plain reply (``none``); OpenAI's ``allowed_tools`` narrows the
    tools of ``auto``/``required``. A plain reply follows ``reply`` where one is given (a
    ``response_format`` beside tools: an agent's final answer), else any text that does not
    start with ``{``."""
    mode, chosen = _resolve_choice(functions, choice, field)
    if mode == "none":
        return reply
    schema = call_schema(chosen, parallel and mode != "named")
    if mode != "auto":
        return StructuredOutputsParams(json=schema)
    return StructuredOutputsParams(
        grammar=f"start: call | reply\ncall: %json {json.dumps(schema)}\nreply: "
        + _reply_rule(reply)
    )


def _resolve_choice(
    functions: list[dict[str, Any]], choice: Any, field: str
) -> tuple[str, list[dict[str, Any]]]:
    """``tool_choice`` as a mode (none, auto, required, named) and the tools it offers."""
    if choice is None:
        return "auto", functions
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(
                f"{field}: expected one of {CHOICES} or a named function, got {choice!r}"
            )
        return choice, functions
    if not isinstance(choice, Mapping):
        raise ValueError(f"{field}: expected one of {CHOICES} or an object, got {choice!r}")
    kind = choice.get("type", "function")
    if kind == "function":
        return "named", _named(functions, choice.get("function"), f"{field}.function")
    if kind == "allowed_tools":
        allowed = choice.get("allowed_tools")
        where = f"{field}.allowed_tools"
        if not isinstance(allowed, Mapping):
            raise ValueError(f"{where}: expected an object with a mode and tools")
        mode = allowed.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise ValueError(f"{where}.mode: expected 'auto' or 'required', got {mode!r}")
        tools = allowed.get("tools")
        if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
            raise ValueError(f"{where}.tools: expected a non-empty list of tools")
        chosen = []
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            chosen += _named(functions, function, f"{where}.tools[{i}].function")
        return mode, chosen
    raise ValueError(f"{field}.type: expected 'function' or 'allowed_tools', got {kind!r}")


def _named(functions: list[dict[str, Any]], function: Any, where: str) -> list[dict[str, Any]]:
    """The one tool ``{"name": ...}`` names."""
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.name: expected the name of one of the tools")
    chosen = [f for f in functions if f["name"] == function["name"]]
    if not chosen:
        raise ValueError(
            f"{where}.name: {function['name']!r} is not one of the tools "
            f"{[f['name'] for f in functions]}"
        )
    return chosen


def _reply_rule(reply: StructuredOutputsParams | None) -> str:
    """The grammar rule of a plain reply beside calls."""
    if reply is None:
        return "/[^{](.|\\n)*/"
    if reply.json is not None:
        schema = json.loads(reply.json) if isinstance(reply.json, str) else reply.json
        return f"%json {json.dumps(with_json_layout(schema))}"
    if reply.json_object:
        return f"%json {json.dumps(with_json_layout({'type': 'object'}))}"
    if reply.choice is not None:
        return " | ".join(map(json.dumps, reply.choice))
    raise ValueError(
        f"structured_outputs.{reply.kind}: beside tools, a reply's format is a JSON schema, a "
        f"JSON object or choices, not a {reply.kind}"
    )


def call_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """``{"tool_calls": [{"name": <one of the tools>, "arguments": <its parameters>}, ...]}``,
    generated compact (the separators the history is rendered with)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": _closed(f["parameters"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    items: dict[str, Any] = {"anyOf": calls} if len(calls) > 1 else calls[0]
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
        "x-guidance": JSON_LAYOUT,
    }


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema with no properties beyond those it names, unless it says
    otherwise (OpenAI's strict mode): a 135M model left free keeps inventing keys."""
    if parameters.get("type", "object") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


CALLS_PREFIX = '{"tool_calls": ['
_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


class CallScan(NamedTuple):
    """What a (possibly unfinished) reply in the call format holds so far: each call's name
    and the text of its arguments up to here, whether that call's arguments are complete,
    and whether the whole reply is."""

    calls: list[tuple[str, str, bool]]
    complete: bool


def is_call_reply(text: str) -> bool:
    """Whether ``text`` (or the reply it begins) is a call rather than a plain reply."""
    return text.startswith(CALLS_PREFIX) or CALLS_PREFIX.startswith(text) and text != ""


def scan_calls(text: str) -> CallScan:
    """The calls of a whole (or unfinished) reply, as far as it goes."""
    return CallScanner().feed(text)


class CallScanner:
    """Reads a reply in the call format as it grows, each character once (a stream feeds it
    every delta): append-only, so a stream can send each call's name once and its arguments
    in fragments that join to the final text."""

    def __init__(self) -> None:
        self.text = ""
        self._calls: list[tuple[str, int]] = []  # each call's name and where its arguments begin
        self._ends: list[int] = []  # where the complete calls' arguments end
        self._header_at = len(CALLS_PREFIX)  # where the next call's header is expected
        self._value: _ValueScan | None = None  # the arguments being read
        self._after: int | None = None  # a call's end, its separator not read yet
        self._complete = False

    def feed(self, text: str) -> CallScan:
        self.text += text
        t = self.text
        if not t.startswith(CALLS_PREFIX):
            return CallScan([], False)
        while not self._complete:
            if self._after is not None:
                rest = t[self._after :]
                if rest.startswith("}, "):
                    self._header_at, self._after = self._after + 3, None
                    continue
                self._complete = rest == "}]}"
                break
            if self._value is None:
                header = _HEADER.match(t, self._header_at)
                if header is None:
                    break
                self._calls.append((json.loads(header.group(1)), header.end()))
                self._value = _ValueScan(header.end())
            end = self._value.advance(t)
            if end is None:
                break
            self._ends.append(end)
            self._value, self._after = None, end
        return self.scan()

    def spans(self) -> list[tuple[str, int, int | None]]:
        """Each call's name and where its arguments begin and end (None: not yet) in
        ``text``: a stream slices only what it has not sent."""
        ends: list[int | None] = [*self._ends, None]
        return [(name, start, ends[min(k, len(ends) - 1)]) for k, (name, start) in
                enumerate(self._calls)]

    def scan(self) -> CallScan:
        calls = [(name, self.text[start:end], end is not None)
                 for name, start, end in self.spans()]
        return CallScan(calls, self._complete)


class _ValueScan:
    """Where a JSON object or array ends, found by reading on from where it stopped."""

    def __init__(self, start: int) -> None:
        self.at = start
        self.depth = 0
        self.in_string = self.escaped = False

    def advance(self, text: str) -> int | None:
        """The index after the value's last character, or None (not there yet)."""
        for i in range(self.at, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.at = i + 1
                    return i + 1
        self.at = len(text)
        return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> list[ToolCall] | None:
    """The calls of a finished reply in this format, their arguments as the model wrote them;
    None for a plain reply or one cut before its end."""
    scan = scan_calls(text)
    if not scan.complete:
        return None
    try:
        for _, arguments, _ in scan.calls:
            json.loads(arguments)
    except ValueError:
        return None
    return [ToolCall(new_call_id(), name, arguments) for name, arguments, _ in scan.calls]


def cut_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a reply cut before its end (``max_tokens``), their arguments as far as the
    model got (not valid JSON then): what a stream of the reply has sent. OpenAI's answer to
    a call cut short: ``tool_calls`` with ``finish_reason`` "length"."""
    return [ToolCall(new_call_id(), name, arguments) for name, arguments, _ in
            scan_calls(text).calls]


def calls_text(calls: Sequence[tuple[str, str]]) -> str:
    """An assistant turn that made ``calls`` ((name, arguments JSON text) pairs), rendered as
    the model generated it, so the history re-encodes to the same text."""
    parts = [
        '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + arguments + "}"
        for name, arguments in calls
    ]
    return '{"tool_calls": [' + ", ".join(parts) + "]}"

