"""``ToolUse``: one request's (or one chat session's) tools, what every door calls.

``Engine.generate(tools=...)``, ``ChatSession``, the chat endpoint, ``/v1/responses`` and
``/tokenize`` each make one, checked once when made (a ValueError names the field:
``tools[i]...``, ``tool_choice...``, in the same words for every caller), then ask it once for
the prompt (``prepare``: the conversation as the model reads it, its earlier calls and the
tools written by the format, and what the reply must match) and read the reply back through
it (``calls``/``parse`` whole, ``stream`` as it streams). A door that may have no tools makes
the one call ``prepare(messages, tools, ...)`` (module level), which does both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from engine.api.outputs import RequestOutput, ToolCall
from engine.serving.conversation import ToolConversation
from engine.serving.tools.checks import ToolChoice, check_tools, resolve_choice
from engine.serving.tools.format import ToolFormat
from engine.serving.tools.radixkv import RADIXKV
from engine.serving.tools.stream import CallStream
from scheduler import SamplingParams, StructuredOutputsParams

# The errors every front door says in the same words.
NO_TOOLS = "tool_choice: only allowed when tools are given"
CONVERSATIONS_ONLY = "prompts: tools are offered in conversations (lists of messages)"

# A conversation's message: {"role", "content"}, or an assistant turn that called tools,
# {"role": "assistant", "tool_calls": [(name, arguments JSON text), ...]}.
Message = Mapping[str, Any]


class ToolPrompt(NamedTuple):
    """What the tools make of a request: the conversation as the model reads it and what the
    reply must match (None: anything)."""

    messages: list[dict[str, str]]
    structure: StructuredOutputsParams | None

    def constrained(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the reply constrained (a changed copy of the frozen params)."""
        return msgspec.structs.replace(params, structured_outputs=self.structure)


def render_history(
    messages: Sequence[Message], tool_format: ToolFormat = RADIXKV
) -> list[dict[str, str]]:
    """The conversation with its assistant turns that called tools written as the model
    wrote them (by ``tool_format``), so a history re-encodes to the tokens it generated."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls is None:
            out.append(dict(message))
        else:
            out.append({"role": message["role"], "content": tool_format.render_calls(calls)})
    return out


class ToolUse:
    """One request's tools, in ``tool_format`` (the model's; radixkv's own by default)."""

    def __init__(
        self,
        tools: Any,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        tool_format: ToolFormat = RADIXKV,
    ) -> None:
        self.functions = check_tools(tools)
        self.choice: ToolChoice = resolve_choice(self.functions, tool_choice)
        self.parallel_tool_calls = parallel_tool_calls
        self.format = tool_format
        # "none": the tools are shown, never called; the reply keeps its own format
        self.calling = self.choice.mode != "none"

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

    def prepare(
        self, messages: Sequence[Message], reply: StructuredOutputsParams | None = None
    ) -> ToolPrompt:
        """The conversation as the model reads it beside the tools (whatever ``tool_choice``
        says: byte-stable, so every turn of an agent hits the cache) and what the reply must
        match: calls as ``tool_choice`` and ``parallel_tool_calls`` allow, or a plain reply in
        ``reply``'s format (the reply's own structured output)."""
        history = self.format.render(render_history(messages, self.format), self.functions)
        tools = self.format.template_tools(self.functions)
        if tools is not None:  # the template writes them: they travel with the messages
            history = ToolConversation(history, tools)
        return ToolPrompt(history, self.constraint(reply))

    def constraint(
        self, reply: StructuredOutputsParams | None = None
    ) -> StructuredOutputsParams | None:
        """What the reply must match (see ``prepare``)."""
        return self.format.constraint(self.choice, self.parallel_tool_calls, reply)

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


def prepare(
    messages: Sequence[Message],
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    reply: StructuredOutputsParams | None = None,
    tool_format: ToolFormat = RADIXKV,
) -> tuple[ToolUse | None, ToolPrompt]:
    """A door's one call for a conversation, with or without tools: its earlier calls
    written by ``tool_format``, the ``tools`` offered (None: none; a ``tool_choice`` without
    them is refused) and what the reply must match (``reply``, the request's own format,
    where no call is forced). The ``ToolUse`` reads the reply back (None: no tools)."""
    use = ToolUse.offered(tools, tool_choice, parallel_tool_calls, tool_format)
    if use is None:
        return None, ToolPrompt(render_history(messages, tool_format), reply)
    return use, use.prepare(messages, reply)
