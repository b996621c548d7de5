"""radixkv's own tool format, for models without one: fixed and documented.

The tools are written into the system turn as JSON, one per line, after a fixed instruction;
a call is the model's whole reply, a compact JSON object ``{"tool_calls": [{"name": ...,
"arguments": {...}}]}``, which structured outputs force to be valid for the tool's
``parameters`` schema (``required`` or a named tool: a call and nothing else; ``auto``: a call
or a plain reply that does not start with ``{``, or one in the request's own format, e.g. the
JSON schema of an agent's final answer). Everything is rendered byte-stable (fixed
separators, arguments kept as the text the model generated), so an agent's step k+1 prompt
begins with step k's prompt and reply and hits the cache.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from engine.api.outputs import ToolCall
from engine.model.structured import JSON_LAYOUT, with_json_layout
from engine.serving.tools.checks import ToolChoice
from engine.serving.tools.format import CallReader, new_call_id, one_call_schema
from scheduler import StructuredOutputsParams

INSTRUCTION = (
    "You can call functions. The functions you can call, one JSON object per line:\n"
    "{tools}\n"
    'To call functions, reply with only a JSON object: {{"tool_calls": [{{"name": '
    '"<function name>", "arguments": {{<arguments>}}}}]}}. Otherwise reply in plain text.'
)
SEPARATORS = (", ", ": ")  # what the constrained JSON is generated with, and rendered with


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
    choice: ToolChoice, parallel: bool = True, reply: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """What the reply must match: a call (``required``, a named function), a call or a plain
    reply (``auto``), or a plain reply (``none``), over the functions ``choice`` offers. A
    plain reply follows ``reply`` where one is given (a ``response_format`` beside tools: an
    agent's final answer), else any text that does not start with ``{``."""
    if choice.mode == "none":
        return reply
    schema = call_schema(choice.functions, parallel and choice.mode != "named")
    if choice.mode != "auto":
        return StructuredOutputsParams(json=schema)
    return StructuredOutputsParams(
        grammar=f"start: call | reply\ncall: %json {json.dumps(schema)}\nreply: "
        + reply_rule(reply)
    )


def reply_rule(reply: StructuredOutputsParams | None) -> str:
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
    items = {k: v for k, v in one_call_schema(functions).items() if k != "x-guidance"}
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
        self._value: ValueScan | None = None  # the arguments being read
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
                self._value = ValueScan(header.end())
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


class ValueScan:
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


class RadixkvToolFormat:
    """radixkv's own format (the functions above): the tools as JSON lines in the system
    turn, a call as the whole reply ``{"tool_calls": [...]}``."""

    name = "radixkv"

    def template_tools(self, functions: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        return None  # written into the system turn by ``render``, not by the template

    def render(
        self, messages: list[dict[str, str]], functions: list[dict[str, Any]]
    ) -> list[dict[str, str]]:
        return with_tools(messages, functions)

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return calls_text(calls)

    def constraint(
        self, choice: ToolChoice, parallel: bool, reply: StructuredOutputsParams | None
    ) -> StructuredOutputsParams | None:
        return tool_constraint(choice, parallel, reply)

    def may_be_call(self, text: str) -> bool:
        return is_call_reply(text)

    def reader(self) -> CallReader:
        return CallScanner()

    def parse(self, text: str) -> list[ToolCall] | None:
        return parse_tool_calls(text)

    def cut(self, text: str) -> list[ToolCall]:
        return cut_tool_calls(text)


RADIXKV = RadixkvToolFormat()
