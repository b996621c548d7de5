"""``CallStream``: one streamed reply read as it grows, while it may be a tool call.

The chat endpoint, ``/v1/responses`` and a streamed ``ChatSession`` turn read a streamed reply
through it, in any ``ToolFormat``: held until its first characters decide whether it is a call,
then, for a call, OpenAI's deltas: each call's id, type and name once, then its arguments in
the fragments that arrive (they join to the final arguments).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.api.outputs import RequestOutput, TokenLogprob, ToolCall
from engine.serving.tools.format import ToolFormat, new_call_id


class CallStream:
    """One reply while it streams and may be a call: held until its first characters decide,
    then, for a call, OpenAI's deltas as the text grows: each call's id, type and name once,
    then its arguments in the fragments that arrive (they join to the final arguments).
    ``finish`` gives the output with the calls the deltas named (the same ids), so a streamed
    ``ChatSession`` turn and the chat endpoint read a reply the same way."""

    def __init__(self, tool_format: ToolFormat) -> None:
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
