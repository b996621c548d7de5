"""Tool use in one place: what ``Engine.generate(tools=...)``, ``ChatSession`` and the chat
endpoint each did for themselves (check the tools, render them into the conversation,
constrain the reply, read the calls back from a finished or a streamed reply).

A ``ToolFormat`` is how a model family writes tools and calls; ``RADIXKV`` (radixkv's own
format, ``engine.serving.tools``) is the one implementation, used for models that have no
format of their own. A family's format plugs in as another ``ToolFormat`` given to
``ToolUse``; nothing above it changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec

from engine.api.outputs import RequestOutput, TokenLogprob, ToolCall
from engine.serving import tools as radixkv_tools
from engine.serving.tools import check_json_schema as check_json_schema  # any format's
from scheduler import SamplingParams, StructuredOutputsParams

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
    """radixkv's own format (``engine.serving.tools``): the tools as JSON lines in the system
    turn, a call as the whole reply ``{"tool_calls": [...]}``."""

    def render(
        self, messages: list[dict[str, str]], functions: list[dict[str, Any]]
    ) -> list[dict[str, str]]:
        return radixkv_tools.with_tools(messages, functions)

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return radixkv_tools.calls_text(calls)

    def constraint(
        self,
        functions: list[dict[str, Any]],
        choice: Any,
        parallel: bool,
        reply: StructuredOutputsParams | None,
    ) -> StructuredOutputsParams | None:
        return radixkv_tools.tool_constraint(functions, choice, parallel, reply=reply)

    def may_be_call(self, text: str) -> bool:
        return radixkv_tools.is_call_reply(text)

    def reader(self) -> CallReader:
        return radixkv_tools.CallScanner()

    def parse(self, text: str) -> list[ToolCall] | None:
        return radixkv_tools.parse_tool_calls(text)

    def cut(self, text: str) -> list[ToolCall]:
        return radixkv_tools.cut_tool_calls(text)


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
        self.functions = radixkv_tools.check_tools(tools)
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
                self._sent.append((radixkv_tools.new_call_id(), 0))
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
