"""``ToolFormat``: how a model family writes tools into a conversation and calls into a reply.

The plug point for tool calling: ``ToolUse`` (every door's one object) speaks only through
it, so a family's own format (a different section in the system turn, calls in tags of its
own) is one more implementation, and nothing above changes. radixkv's own format, for models
without one, is ``engine.serving.tools.radixkv.RADIXKV``; Hermes / Qwen's is
``engine.serving.tools.hermes.HERMES``; ``engine.serving.tools.choice.tool_format_for`` picks
one by the model's chat template.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from engine.api.outputs import ToolCall
from engine.serving.tools.checks import ToolChoice
from scheduler import StructuredOutputsParams


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

    name: str

    def template_tools(self, functions: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The tools as the model's chat template takes them (``tools=``), where the template
        writes them itself; None where ``render`` writes them into the messages."""
        ...

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
        self, choice: ToolChoice, parallel: bool, reply: StructuredOutputsParams | None
    ) -> StructuredOutputsParams | None:
        """What the reply must match for ``choice``; ``reply``, the format of a reply that is
        not a call. ValueError naming what cannot be combined."""
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


def new_call_id() -> str:
    """The id a call gets when it is read from a reply (OpenAI's ``call_...``)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def one_call_schema(
    functions: list[dict[str, Any]], arguments_key: str = "arguments"
) -> dict[str, Any]:
    """One call as JSON: ``{"name": <one of the tools>, <arguments_key>: <its parameters>}``,
    with no properties beyond those a tool's schema names (OpenAI's strict mode: a small
    model left free keeps inventing keys), laid out compact."""
    from engine.model.structured import JSON_LAYOUT

    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, arguments_key: closed(f["parameters"])},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"anyOf": calls} if len(calls) > 1 else calls[0]
    return {**schema, "x-guidance": JSON_LAYOUT}


def closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema with no properties beyond those it names, unless it says
    otherwise."""
    if parameters.get("type", "object") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def read_calls(scanner: Any, text: str, whole: bool) -> list[ToolCall] | None:
    """The calls ``scanner`` (a fresh reader with ``complete``) finds in ``text``. ``whole``:
    only a finished reply of calls with valid JSON arguments, else None; otherwise the calls
    as far as they got (a reply cut short)."""
    scanner.feed(text)
    if whole and not scanner.complete:
        return None
    calls = [(name, text[start:end]) for name, start, end in scanner.spans()]
    if whole:
        try:
            for _, arguments in calls:
                json.loads(arguments)
        except ValueError:
            return None
    return [ToolCall(new_call_id(), name, arguments) for name, arguments in calls]

