"""Multi-turn chat sessions whose every turn reuses the KV of the conversation so far.

The prompt of turn k+1 is built as token ids: exactly the tokens of turn k's prompt and reply
(the reply as the model generated it, end-of-turn token included), followed by the tokens of
the text the chat template adds after them (end of the reply if it was cut, the new user
message, the assistant header). Re-tokenising the whole rendered conversation instead could
split the reply differently from how the model generated it, and every token after the first
difference would miss the cache. The text is the template's either way.

When the rendered conversation does not start with the decoded previous tokens (a reply cut
at a stop string, special tokens inside a reply), the longest prefix of the previous tokens
that does is kept; ``last_dropped_tokens`` says how many were not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.api import RequestOutput, TextStream, abort_on_exit
from engine.serving.conversation import (
    ToolConversation,
    check_text,
    continue_conversation,
    tools_of,
)
from engine.serving.inputs import check_namespace
from engine.serving.tools import CallStream, ToolUse
from scheduler import SamplingParams

if TYPE_CHECKING:
    from engine.api import EngineClient


class ChatSession:
    """A conversation with the engine's model. Not thread-safe: one turn at a time.

    ``send(text)`` returns the reply; ``stream(text)`` yields its text deltas and then the
    RequestOutput (``last_output`` too). A turn that is aborted or fails leaves the history
    as it was. ``fork()`` branches the conversation: both sessions share the KV of the common
    history through the prefix cache.
    """

    def __init__(
        self,
        engine: EngineClient,
        system: str | None = None,
        params: SamplingParams | None = None,
        namespace: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> None:
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system: expected str or None, got {type(system).__name__}")
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        check_namespace(namespace)
        self._engine = engine
        self._params = params
        self._namespace = namespace
        self._messages: list[dict[str, str]] = (
            [{"role": "system", "content": system}] if system is not None else []
        )
        self._tool_use = ToolUse.offered(tools, tool_choice, tool_format=engine.tool_format)
        if self._tool_use is not None:  # the tool section joins the system turn once
            base = params or SamplingParams()
            prompt = self._tool_use.prepare(self._messages, base.structured_outputs)
            self._params, self._messages = prompt.constrained(base), prompt.messages
        # tools the chat template writes itself (Hermes / Qwen) go with every turn's messages
        self._template_tools: list[dict[str, Any]] | None = tools_of(self._messages)
        self._messages = list(self._messages)
        self._conversation_ids: list[int] = []  # last turn's prompt + reply tokens
        self.last_output: RequestOutput | None = None
        self.last_dropped_tokens = 0  # previous tokens not reused verbatim by the last turn

    @property
    def messages(self) -> list[dict[str, str]]:
        """The conversation so far (a copy)."""
        return [dict(m) for m in self._messages]

    @property
    def token_ids(self) -> list[int]:
        """Prompt + reply tokens of the last turn: the prefix the next turn starts with."""
        return list(self._conversation_ids)

    def send(self, text: str, params: SamplingParams | None = None, role: str = "user") -> str:
        """Sends one message (``role`` "user", or "tool" for a tool's result); returns the
        assistant's reply text (with tools, ``last_output.tool_calls`` has its calls)."""
        messages, ids = self._prepare_turn(text, role)
        handle = self._engine.submit(ids, self._params_for(params), self._namespace)
        with abort_on_exit([handle]):  # interrupted: the turn is dropped
            output = handle.result()
        return self._record(messages, ids, output).text

    def stream(
        self, text: str, params: SamplingParams | None = None, role: str = "user"
    ) -> TextStream:
        """Like ``Engine.stream``: text deltas, then the RequestOutput (with tools, its
        parsed calls, as ``last_output``); closing early aborts. The request is submitted on
        the first ``next()``. ``role`` as for ``send``."""
        messages, ids = self._prepare_turn(text, role)
        params = self._params_for(params)

        def start() -> Any:
            return self._engine.submit(ids, params, self._namespace, stream=True)

        if self._tool_use is None or not self._tool_use.calling:
            stream = TextStream(start)
            stream.on_output = lambda output: self._record(messages, ids, output)
            return stream
        calls = self._tool_use.stream()  # the chat endpoint's reader of a streamed reply
        stream = _ToolTurnStream(start, calls)
        stream.on_output = lambda output: self._record(messages, ids, calls.finish(output),
                                                       parsed=True)
        return stream

    def fork(self) -> ChatSession:
        """An independent copy of this session (same history, params and namespace)."""
        branch = ChatSession(self._engine, params=self._params, namespace=self._namespace)
        branch._tool_use = self._tool_use
        branch._messages = self.messages
        branch._conversation_ids = list(self._conversation_ids)
        branch.last_output = self.last_output
        branch.last_dropped_tokens = self.last_dropped_tokens
        return branch

    def _params_for(self, params: SamplingParams | None) -> SamplingParams | None:
        return params if params is not None else self._params

    def _prepare_turn(
        self, text: str, role: str = "user"
    ) -> tuple[list[dict[str, str]], list[int]]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected str, got {type(text).__name__}")
        if not text:
            raise ValueError("text: empty message")
        if role not in ("user", "tool"):
            raise ValueError(f"role: expected 'user' or 'tool', got {role!r}")
        check_text(text, "text")
        messages = [*self.messages, {"role": role, "content": text}]
        if self._template_tools is not None:
            messages = ToolConversation(messages, self._template_tools)
        ids, reused = continue_conversation(
            self._engine.tokenizer, self._conversation_ids, messages, "text"
        )
        self.last_dropped_tokens = len(self._conversation_ids) - reused
        return messages, self._engine.encode(ids, "text")  # checked here, once

    def _record(self, messages: list[dict[str, str]], prompt_ids: list[int],
                output: RequestOutput, parsed: bool = False) -> RequestOutput:
        """Adds the turn to the history (unless aborted); the output as the caller gets it
        (with tools, its calls parsed, unless a stream's reader did: ``parsed``)."""
        if output.finish_reason == "abort":
            return output
        if self._tool_use is not None and not parsed:
            output = self._tool_use.parse(output)
        self._messages = [*messages, {"role": "assistant", "content": output.text}]
        self._conversation_ids = list(prompt_ids) + list(output.token_ids)
        self.last_output = output
        return output


class _ToolTurnStream(TextStream):
    """A streamed turn with tools: every text delta also goes to the turn's ``CallStream``,
    which reads the reply as the chat endpoint reads a streamed choice."""

    def __init__(self, start: Any, calls: CallStream) -> None:
        super().__init__(start)
        self._calls = calls

    def __next__(self) -> str | RequestOutput:
        item = super().__next__()
        if isinstance(item, str):
            self._calls.reading(item)
        return item
