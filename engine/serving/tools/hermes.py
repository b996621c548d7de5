"""The Hermes / Qwen tool format: the model's own chat template writes the tools, a call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.

Qwen2.5, Qwen3 and Hermes-style fine-tunes are trained on it: their templates render the
tools (``tools=`` to the template, which this format asks for with ``template_tools``) and a
tool's result (role "tool") themselves. A reply's calls are constrained by the same grammar
machinery as radixkv's own format, each call's arguments by its tool's ``parameters``; an
earlier call is rendered back as the block the model generated, so the next turn's prompt
begins with this turn's tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from engine.api.outputs import ToolCall
from engine.serving.tools.checks import ToolChoice
from engine.serving.tools.format import CallReader, one_call_schema, read_calls
from engine.serving.tools.radixkv import ValueScan, reply_rule
from scheduler import StructuredOutputsParams

OPEN, CLOSE, BETWEEN = "<tool_call>\n", "\n</tool_call>", "\n"
_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


class HermesScanner:
    """A reply in this format read as it grows (append-only): each block's name and where its
    arguments begin and end; whether the reply is whole (nothing after its last block)."""

    def __init__(self) -> None:
        self.text = ""
        self._calls: list[tuple[str, int]] = []
        self._ends: list[int] = []
        self._next = 0  # where the next block is expected
        self._value: ValueScan | None = None
        self._after: int | None = None  # a call's arguments ended here; its close not read yet

    def feed(self, text: str) -> None:
        self.text += text
        t = self.text
        while True:
            if self._after is not None:
                close = "}" + CLOSE
                if not t.startswith(close, self._after):
                    return
                self._next, self._after = self._after + len(close), None
                continue
            if self._value is None:
                at = self._next + (len(BETWEEN) if self._calls else 0)
                if not t.startswith(OPEN, at):
                    return
                header = _HEADER.match(t, at + len(OPEN))
                if header is None:
                    return
                self._calls.append((json.loads(header.group(1)), header.end()))
                self._value = ValueScan(header.end())
            end = self._value.advance(t)
            if end is None:
                return
            self._ends.append(end)
            self._value, self._after = None, end

    def spans(self) -> list[tuple[str, int, int | None]]:
        ends: list[int | None] = [*self._ends, None]
        return [(name, start, ends[min(k, len(ends) - 1)])
                for k, (name, start) in enumerate(self._calls)]

    @property
    def complete(self) -> bool:
        """Every block closed and nothing else in the reply (whitespace aside)."""
        closed = self._value is None and self._after is None and bool(self._calls)
        return closed and not self.text[self._next :].strip()


class HermesToolFormat:
    """``ToolFormat`` of Hermes / Qwen chat templates (see the module docstring)."""

    name = "hermes"

    def template_tools(self, functions: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        return [{"type": "function", "function": f} for f in functions]

    def render(
        self, messages: list[dict[str, str]], functions: list[dict[str, Any]]
    ) -> list[dict[str, str]]:
        return messages  # the template writes the tools (``template_tools``)

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return BETWEEN.join(
            OPEN + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
            + arguments + "}" + CLOSE
            for name, arguments in calls
        )

    def constraint(
        self, choice: ToolChoice, parallel: bool, reply: StructuredOutputsParams | None
    ) -> StructuredOutputsParams | None:
        if choice.mode == "none":
            return reply
        call = f"call: {json.dumps(OPEN)} %json {json.dumps(one_call_schema(choice.functions))} " \
            f"{json.dumps(CLOSE)}"
        many = parallel and choice.mode != "named"
        calls = f"calls: call ({json.dumps(BETWEEN)} call)*" if many else "calls: call"
        if choice.mode != "auto":
            return StructuredOutputsParams(grammar=f"start: calls\n{calls}\n{call}")
        plain = "/[^<](.|\\n)*/" if reply is None else reply_rule(reply)
        return StructuredOutputsParams(
            grammar=f"start: calls | reply\n{calls}\n{call}\nreply: {plain}"
        )

    def may_be_call(self, text: str) -> bool:
        return text.startswith(OPEN) or (text != "" and OPEN.startswith(text))

    def reader(self) -> CallReader:
        return HermesScanner()

    def parse(self, text: str) -> list[ToolCall] | None:
        return read_calls(HermesScanner(), text, whole=True)

    def cut(self, text: str) -> list[ToolCall]:
        return read_calls(HermesScanner(), text, whole=False) or []


HERMES = HermesToolFormat()
