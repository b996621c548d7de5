"""Llama 3.1+'s tool format: the chat template writes the tools, a call is the whole reply,
one JSON object ``{"name": ..., "parameters": {...}}``.

Llama 3.1 / 3.2 / 3.3 instruct templates ask for exactly that object ("respond in the format
{"name": function name, "parameters": dictionary of argument name and its value}") and render
a tool's result (role "tool" or "ipython") themselves. One call per reply, as the template
teaches; constrained like the other formats, each call's parameters by its tool's schema,
and rendered back as the object the model generated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from engine.api.outputs import ToolCall
from engine.serving.tools.checks import ToolChoice
from engine.serving.tools.format import one_call_schema, read_calls
from engine.serving.tools.radixkv import ValueScan, reply_rule
from scheduler import StructuredOutputsParams

PREFIX = '{"name": '
_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "parameters": ')


class LlamaCallScanner:
    """A reply in this format read as it grows: the call's name and where its parameters
    begin and end; whole once the object closes with nothing after it."""

    def __init__(self) -> None:
        self.text = ""
        self._call: tuple[str, int] | None = None
        self._end: int | None = None
        self._value: ValueScan | None = None

    def feed(self, text: str) -> None:
        self.text += text
        if self._call is None:
            header = _HEADER.match(self.text)
            if header is None:
                return
            self._call = (json.loads(header.group(1)), header.end())
            self._value = ValueScan(header.end())
        if self._end is None and self._value is not None:
            self._end = self._value.advance(self.text)

    def spans(self) -> list[tuple[str, int, int | None]]:
        return [] if self._call is None else [(self._call[0], self._call[1], self._end)]

    @property
    def complete(self) -> bool:
        return self._end is not None and self.text[self._end :].rstrip() == "}"


class LlamaJsonToolFormat:
    """``ToolFormat`` of Llama 3.1+ chat templates (see the module docstring)."""

    name = "llama3_json"

    def template_tools(self, functions: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        return [{"type": "function", "function": f} for f in functions]

    def render(
        self, messages: list[dict[str, str]], functions: list[dict[str, Any]]
    ) -> list[dict[str, str]]:
        return messages  # the template writes the tools (``template_tools``)

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        if len(calls) != 1:
            raise ValueError("tool_calls: Llama's format makes one call per assistant turn")
        name, arguments = calls[0]
        return PREFIX + json.dumps(name, ensure_ascii=False) + ', "parameters": ' + arguments + "}"

    def constraint(
        self, choice: ToolChoice, parallel: bool, reply: StructuredOutputsParams | None
    ) -> StructuredOutputsParams | None:
        if choice.mode == "none":
            return reply
        schema = one_call_schema(choice.functions, "parameters")
        if choice.mode != "auto":
            return StructuredOutputsParams(json=schema)
        plain = "/[^{](.|\\n)*/" if reply is None else reply_rule(reply)
        return StructuredOutputsParams(
            grammar=f"start: call | reply\ncall: %json {json.dumps(schema)}\nreply: {plain}"
        )

    def may_be_call(self, text: str) -> bool:
        return text.startswith(PREFIX) or (text != "" and PREFIX.startswith(text))

    def reader(self) -> LlamaCallScanner:
        return LlamaCallScanner()

    def parse(self, text: str) -> list[ToolCall] | None:
        return read_calls(LlamaCallScanner(), text, whole=True)

    def cut(self, text: str) -> list[ToolCall]:
        return read_calls(LlamaCallScanner(), text, whole=False) or []


LLAMA_JSON = LlamaJsonToolFormat()
