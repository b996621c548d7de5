"""``POST /v1/chat/completions``: a conversation in, ``n`` assistant messages out, whole or
streamed as ``chat.completion.chunk`` events.

The conversation is rendered with the model's chat template and encoded once (off the event
loop); its ids go to the engine as ``n`` requests that share them, so the scheduler computes
the prompt once. Without ``max_tokens``/``max_completion_tokens`` a choice may use the rest
of the context.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import kept_prompt
from engine import tools as tool_format
from engine.api import RequestOutput, TokenLogprob
from server import protocol
from server.errors import as_api_error, invalid
from server.generation import NO_USAGE, TokenBudget, envelope, parse, stream_usage, submit
from server.protocol import ChatRequest
from server.responses import chat_logprobs, usage_of, vllm_prompt_logprobs
from server.state import ServerState
from server.streaming import Choice, EventStreamResponse, sse, updates, wait


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    req = await parse(state, request, ChatRequest)
    protocol.check_chat_only(req)
    messages = protocol.conversation(req.messages)
    structure = protocol.structured_outputs(req)  # the format of a reply that is not a call
    calling = False
    if req.tools:
        # rendered whatever tool_choice says
        messages, functions = protocol.with_tool_section(messages, req.tools)
        try:
            constraint = tool_format.tool_constraint(
                functions, req.tool_choice, req.parallel_tool_calls, reply=structure
            )
        except ValueError as exc:
            raise invalid(str(exc)) from None
        calling = constraint is not structure  # tool_choice "none" leaves the reply's format
        structure = constraint
    elif req.tool_choice is not None:
        raise invalid("tool_choice: only allowed when tools are given")
    ids = await state.encode(messages, "messages", [m["content"] for m in messages])
    if req.max_completion_tokens is not None:
        budget = TokenBudget("max_completion_tokens", req.max_completion_tokens)
    else:
        budget = TokenBudget("max_tokens", req.max_tokens)
    top = (req.top_logprobs or 0) if req.logprobs else None
    ids = kept_prompt(ids, req.truncate_prompt_tokens, state.engine.max_context)
    params = protocol.choice_params(
        req,
        budget.tokens(len(ids), state.engine.max_context),
        top,
        renames={"max_new_tokens": budget.field, "logprobs": "top_logprobs"},
        structure=structure,
        prompt_logprobs=req.prompt_logprobs,
    )
    choices = submit(
        state, [ids], ["messages"], params, budget, req.cache_salt, req.stream,
        renames=protocol.structure_renames(req, calling),
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        return EventStreamResponse(_stream(state, rid, req, choices, calling))
    outputs = await wait(state, request, choices)
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    items = []
    for c, o in zip(choices, outputs):
        message: dict[str, Any] = {"role": "assistant", "content": o.text}
        reason = o.finish_reason
        calls = tool_format.parse_tool_calls(o.text) if calling else None
        cut = tool_format.cut_tool_calls(o.text) if calling and calls is None else []
        if calls or cut:  # a call cut by max_tokens keeps its arguments as far as they got
            message = {"role": "assistant", "content": None,
                       "tool_calls": [call.to_openai() for call in calls or cut]}
            reason = "tool_calls" if calls else reason
        items.append(
            _item(state, req, c, message, o.token_ids, o.logprobs or [], reason, key="message")
        )
    body = envelope(state, rid, "chat.completion", int(time.time()), items, usage_of([outputs]))
    if req.return_token_ids:
        body["prompt_token_ids"] = ids
    if req.prompt_logprobs is not None:  # vLLM's: one list for the prompt all choices share
        scores = outputs[0].prompt_logprobs or []
        body["prompt_logprobs"] = vllm_prompt_logprobs(scores, state.texts, req.prompt_logprobs)
    return JSONResponse(body)


def _item(
    state: ServerState,
    req: ChatRequest,
    choice: Choice,
    message: dict[str, Any],
    ids: list[int],
    lps: list[TokenLogprob],
    reason: str | None,
    key: str = "delta",
) -> dict[str, Any]:
    """One choice of a response (``key="message"``) or of a chunk (``"delta"``)."""
    item: dict[str, Any] = {
        "index": choice.index,
        key: message,
        "logprobs": chat_logprobs(lps, state.texts) if req.logprobs else None,
        "finish_reason": reason,
    }
    if req.return_token_ids:
        item["token_ids"] = ids
    return item


async def _stream(
    state: ServerState, rid: str, req: ChatRequest, choices: list[Choice], calling: bool = False
) -> AsyncIterator[bytes]:
    """The role chunk of every choice, a chunk per delta, the usage chunk if asked, [DONE];
    an error after the first byte is sent in-band (the status line is long gone). With tools,
    a reply that begins with ``{`` is a call, sent as ``tool_calls`` deltas while it is
    generated: each call's id and name once, then its arguments in fragments."""
    created = int(time.time())
    with_usage = stream_usage(req)
    per_chunk = None if with_usage else NO_USAGE  # OpenAI: "usage": null on every chunk

    def chunk(item: dict[str, Any]) -> bytes:
        return sse(envelope(state, rid, "chat.completion.chunk", created, [item], per_chunk))

    calls = {choice.index: _CallStream() for choice in choices} if calling else {}
    outputs: list[RequestOutput] = []
    try:
        for choice in choices:
            role = {"role": "assistant", "content": ""}
            yield chunk(_item(state, req, choice, role, [], [], None))
        async for u in updates(state, choices):
            stream = calls.get(u.choice.index)
            ids, lps = u.token_ids, u.logprobs
            if stream is not None:  # tokens held back with their text go with its first delta
                ids, lps = stream.carry(ids, lps)
            if stream is not None and stream.reading(u.text):
                deltas = stream.deltas()
                if u.output is not None and not stream.calls_sent and stream.held:
                    deltas.append({"content": stream.take_held()})  # cut before it could tell
                for delta in deltas:
                    yield chunk(_item(state, req, u.choice, delta, ids, lps, None))
                    ids, lps = [], []
                if u.output is None:
                    stream.hold(ids, lps)
                    continue
                called = tool_format.parse_tool_calls(u.output.text) is not None
                reason = "tool_calls" if called else u.output.finish_reason
                yield chunk(_item(state, req, u.choice, {}, ids, lps, reason))
                outputs.append(u.output)
                continue
            text = u.text
            if stream is not None and stream.held:  # a plain reply: the text held so far
                text = stream.take_held()
                if u.output is not None:
                    yield chunk(_item(state, req, u.choice, {"content": text}, ids, lps, None))
                    ids, lps = [], []
            delta = {"content": text} if u.output is None else {}
            reason = None if u.output is None else u.output.finish_reason
            yield chunk(_item(state, req, u.choice, delta, ids, lps, reason))
            if u.output is not None:
                outputs.append(u.output)
        if with_usage:
            usage = usage_of([outputs])
            yield sse(envelope(state, rid, "chat.completion.chunk", created, [], usage))
    except Exception as exc:
        yield sse(as_api_error(exc).body())
    yield sse("[DONE]")


class _CallStream:
    """One choice's reply while it may be a call: held until its first characters decide,
    then, for a call, OpenAI's deltas as the text grows: each call's id, type and name once,
    then its arguments in the fragments that arrive (they join to the final arguments)."""

    def __init__(self) -> None:
        # the reply so far, read once, while it may be a call
        self._scanner = tool_format.CallScanner()
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
        return self._scanner.text

    def take_held(self) -> str:
        """The text held while undecided, once: the reply turned out plain."""
        text, self._scanner = self.held, tool_format.CallScanner()
        return text

    def reading(self, text: str) -> bool:
        """Takes the next text; whether the reply is (still possibly) a call."""
        if self.is_call is False:
            return False
        self._scanner.feed(text)
        if self.held and not tool_format.is_call_reply(self.held):
            self.is_call = False
            return False
        self.is_call = True if self.held else None
        return True

    def deltas(self) -> list[dict[str, Any]]:
        out = []
        text = self.held
        for k, (name, start, end) in enumerate(self._scanner.spans()):
            if k == len(self._sent):
                self._sent.append((tool_format.new_call_id(), 0))
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
