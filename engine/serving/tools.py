"""Tool calling for a model without a tool format of its own: one fixed, documented format.

The tools are written into the system turn as JSON, one per line, after a fixed instruction;
a call is the model's whole reply, a compact JSON object ``{"tool_calls": [{"name": ...,
"arguments": {...}}]}``, which structured outputs force to be valid for the tool's
``parameters`` schema (``required`` or a named tool: a call and nothing else; ``auto``: a call
or a plain reply that does not start with ``{``, or one in the request's own format, e.g. the
JSON schema of an agent's final answer). Everything is rendered byte-stable (fixed
separators, arguments kept as the text the model generated), so an agent's step k+1 prompt
begins with step k's prompt and reply and hits the cache.

Tool use is in one place, below the seam: ``ToolUse`` (end of this module) does what
``Engine.generate(tools=...)``, ``ChatSession`` and the chat endpoint each did for themselves
(check the tools, render them into the conversation, constrain the reply, read the calls back
from a finished reply and, ``CallStream``, from a streamed one). It speaks through a
``ToolFormat``: this format is ``RADIXKV``, the one implementation; a model family's own
format plugs in as another ``ToolFormat`` given to ``ToolUse``, and nothing above it changes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import msgspec

from engine.api.outputs import RequestOutput, TokenLogprob, ToolCall
from engine.model.structured import JSON_LAYOUT, with_json_layout
from scheduler import SamplingParams, StructuredOutputsParams

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


# ------------------------------------------------------------------------------ tool use

# The errors every front door says in the same words.
NO_TOOLS = "tool_choice: only allowed when tools are given"
CONVERSATIONS_ONLY = "prompts: tools are offered in conversations (lists of messages)"


class CallReader(Protocol):
    """A reply in a tool format read as it grows (append-only)."""

    text: str

    def feed(self, text: str) -> Any: ...

    def spans(self) -> list[tuple[str, int, int | None]]:
        """Each call's name and where its arguments begin and end (None: not yet) in
        ``text``."""
        ...


class ToolFormat(Protocol):
    """How a model family writes tools into a conversation and calls into a reply."""

    def render(
        self, messages: list[dict[str, str]], functions: list[dict[str, Any]]
    ) -> list[dict[str, str]]:
        """The conversation with the tools written where the model reads them."""
        ...

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """An assistant turn that made ``calls`` ((name, arguments JSON) pairs), as the model
        wrote it, so a history re-encodes to the tokens it generated."""
        ...

    def constraint(
        self,
        functions: list[dict[str, Any]],
        choice: Any,
        parallel: bool,
        reply: StructuredOutputsParams | None,
    ) -> StructuredOutputsParams | None:
        """What the reply must match for ``tool_choice``; ``reply``, the format of a reply
        that is not a call. ValueError naming ``tool_choice`` when it is not one."""
        ...

    def may_be_call(self, text: str) -> bool:
        """Whether ``text`` (or the reply it begins) is a call rather than a plain reply."""
        ...

    def reader(self) -> CallReader:
        """A reader for a reply as it streams."""
        ...

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls of a finished reply; None for a plain reply or one cut short."""
        ...

    def cut(self, text: str) -> list[ToolCall]:
        """The calls of a reply cut short, their arguments as far as they got."""
        ...


class RadixkvToolFormat:
    """radixkv's own format (the functions above): the tools as JSON lines in the system
    turn, a call as the whole reply ``{"tool_calls": [...]}``."""

    def render(
        self, messages: list[dict[str, str]], functions: list[dict[str, Any]]
    ) -> list[dict[str, str]]:
        return with_tools(messages, functions)

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return calls_text(calls)

    def constraint(
        self,
        functions: list[dict[str, Any]],
        choice: Any,
        parallel: bool,
        reply: StructuredOutputsParams | None,
    ) -> StructuredOutputsParams | None:
        return tool_constraint(functions, choice, parallel, reply=reply)

    def may_be_call(self, text: str) -> bool:
        return is_call_reply(text)

    def reader(self) -> CallReader:
        return CallScanner()

    def parse(self, text: str) -> list[ToolCall] | None:
        return parse_tool_calls(text)

    def cut(self, text: str) -> list[ToolCall]:
        return cut_tool_calls(text)


RADIXKV = RadixkvToolFormat()


class ToolUse:
    """One request's (or one chat session's) tools: checked once when made; a ValueError
    names the field (``tools[i]...``, ``tool_choice...``) in the same words for every
    caller."""

    def __init__(
        self,
        tools: Any,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        tool_format: ToolFormat = RADIXKV,
    ) -> None:
        self.functions = check_tools(tools)
        self.tool_choice = tool_choice
        self.parallel_tool_calls = parallel_tool_calls
        self.format = tool_format
        # "none": the tools are shown, never called; the reply keeps its own format
        self.calling = tool_choice != "none"

    @classmethod
    def offered(
        cls,
        tools: Any,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        tool_format: ToolFormat = RADIXKV,
    ) -> ToolUse | None:
        """The tool use of a request that may have no tools (None: it has none; a
        ``tool_choice`` without tools is refused)."""
        if tools is None:
            if tool_choice is not None:
                raise ValueError(NO_TOOLS)
            return None
        return cls(tools, tool_choice, parallel_tool_calls, tool_format)

    def render(self, messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
        """The conversation as the model reads it beside the tools (whatever ``tool_choice``
        says: byte-stable, so every turn of an agent hits the cache)."""
        return self.format.render([dict(m) for m in messages], self.functions)

    def constraint(
        self, reply: StructuredOutputsParams | None = None
    ) -> StructuredOutputsParams | None:
        """What the reply must match: calls as ``tool_choice`` and ``parallel_tool_calls``
        allow, or a plain reply in ``reply``'s format (the reply's own structured output)."""
        return self.format.constraint(
            self.functions, self.tool_choice, self.parallel_tool_calls, reply
        )

    def constrain(self, params: Sequence[SamplingParams]) -> list[SamplingParams]:
        """Each of ``params`` with its reply constrained (changed copies of the frozen
        params; one per distinct params, so shared params stay shared)."""
        copies: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in copies:
                structure = self.constraint(p.structured_outputs)
                copies[id(p)] = msgspec.structs.replace(p, structured_outputs=structure)
        return [copies[id(p)] for p in params]

    def calls(self, text: str) -> tuple[list[ToolCall], bool]:
        """The calls of a finished reply and whether they are whole: a reply cut short
        (``max_tokens``) keeps its calls' arguments as far as they got (OpenAI's answer:
        ``tool_calls`` with finish_reason "length"); a plain reply has none."""
        if not self.calling:
            return [], False
        whole = self.format.parse(text)
        return (whole, True) if whole is not None else (self.format.cut(text), False)

    def parse(self, output: RequestOutput) -> RequestOutput:
        """``output`` with its calls (finish_reason "tool_calls"), or as it was."""
        calls = self.format.parse(output.text) if self.calling else None
        if not calls:
            return output
        return msgspec.structs.replace(output, tool_calls=calls, finish_reason="tool_calls")

    def stream(self) -> CallStream:
        """A reader of one streamed reply (see ``CallStream``)."""
        return CallStream(self.format)


class CallStream:
    """One reply while it streams and may be a call: held until its first characters decide,
    then, for a call, OpenAI's deltas as the text grows: each call's id, type and name once,
    then its arguments in the fragments that arrive (they join to the final arguments).
    ``finish`` gives the output with the calls the deltas named (the same ids), so a streamed
    ``ChatSession`` turn and the chat endpoint read a reply the same way."""

    def __init__(self, tool_format: ToolFormat = RADIXKV) -> None:
        self._format = tool_format
        self._reader = tool_format.reader()  # the reply so far, read once, while it may be a call
        self.is_call: bool | None = None
        self._sent: list[tuple[str, int]] = []  # per call: its id, argument characters sent
        self._held_ids: list[int] = []  # tokens of updates that sent no chunk yet
        self._held_lps: list[TokenLogprob] = []

    @property
    def calls_sent(self) -> bool:
        return bool(self._sent)

    def hold(self, ids: list[int], lps: list[TokenLogprob]) -> None:
        """Keeps tokens no chunk carried, for the next chunk."""
        self._held_ids, self._held_lps = ids, lps

    def carry(
        self, ids: list[int], lps: list[TokenLogprob]
    ) -> tuple[list[int], list[TokenLogprob]]:
        """The held tokens, then ``ids``/``lps``: the tokens the next chunk carries."""
        ids, lps = [*self._held_ids, *ids], [*self._held_lps, *lps]
        self._held_ids, self._held_lps = [], []
        return ids, lps

    @property
    def held(self) -> str:
        return self._reader.text

    def take_held(self) -> str:
        """The text held while undecided, once: the reply turned out plain."""
        text, self._reader = self.held, self._format.reader()
        return text

    def reading(self, text: str) -> bool:
        """Takes the next text; whether the reply is (still possibly) a call."""
        if self.is_call is False:
            return False
        self._reader.feed(text)
        if self.held and not self._format.may_be_call(self.held):
            self.is_call = False
            return False
        self.is_call = True if self.held else None
        return True

    def deltas(self) -> list[dict[str, Any]]:
        """OpenAI's ``tool_calls`` deltas for what was read since the last call."""
        out = []
        text = self.held
        for k, (name, start, end) in enumerate(self._reader.spans()):
            if k == len(self._sent):
                self._sent.append((new_call_id(), 0))
                head = {"index": k, "id": self._sent[k][0], "type": "function",
                        "function": {"name": name, "arguments": ""}}
                out.append({"tool_calls": [head]})
            call_id, sent = self._sent[k]
            stop = len(text) if end is None else end
            if start + sent < stop:
                piece = {"index": k, "function": {"arguments": text[start + sent : stop]}}
                out.append({"tool_calls": [piece]})
                self._sent[k] = (call_id, stop - start)
        return out

    def finish(self, output: RequestOutput) -> RequestOutput:
        """The final output with its calls (finish_reason "tool_calls"), under the ids the
        deltas gave them, or as it was (a plain reply, or calls cut short)."""
        calls = self._format.parse(output.text)
        if not calls:
            return output
        ids = [call_id for call_id, _ in self._sent]
        named = [ToolCall(ids[k] if k < len(ids) else c.id, c.name, c.arguments)
                 for k, c in enumerate(calls)]
        return msgspec.structs.replace(output, tool_calls=named, finish_reason="tool_calls")
