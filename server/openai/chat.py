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

from engine import tools as tool_format
from engine.api import RequestOutput, TokenLogprob
from server import protocol
from server.errors import as_api_error
from server.generation import TokenBudget, parse, submit
from server.openai import records
from server.openai.bodies import (
    NO_USAGE,
    chat_logprobs,
    envelope,
    stream_usage,
    usage_of,
    vllm_prompt_logprobs,
)
from server.openai.records import ChatRequest
from server.state import ServerState
from server.streaming import Choice, EventStreamResponse, sse, updates, wait


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    req = await parse(state, request, ChatRequest)
    records.check_chat_only(req)
    tools, (messages, structure) = protocol.tool_prompt(
        state.engine, protocol.conversation(req.messages), req.tools, req.tool_choice,
        req.parallel_tool_calls, records.structured_outputs(req),  # a reply that is no call
    )
    calling = tools is not None and tools.calling  # "none" leaves the reply's format
    texts = [m["content"] for m in messages]
    ids = await state.encode(messages, "messages", texts, req.truncate_prompt_tokens)
    if req.max_completion_tokens is not None:
        budget = TokenBudget("max_completion_tokens", req.max_completion_tokens)
    else:
        budget = TokenBudget("max_tokens", req.max_tokens)
    top = (req.top_logprobs or 0) if req.logprobs else None
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
        renames=records.structure_renames(req, calling),
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        return EventStreamResponse(_stream(state, rid, req, choices, tools if calling else None))
    outputs = await wait(state, request, choices)
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    items = []
    for c, o in zip(choices, outputs):
        message: dict[str, Any] = {"role": "assistant", "content": o.text}
        reason = o.finish_reason
        calls, whole = tools.calls(o.text) if tools is not None else ([], False)
        if calls:  # a call cut by max_tokens keeps its arguments as far as they got
            message = {"role": "assistant", "content": None,
                       "tool_calls": [call.to_openai() for call in calls]}
            reason = "tool_calls" if whole else reason
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
    state: ServerState,
    rid: str,
    req: ChatRequest,
    choices: list[Choice],
    tools: tool_format.ToolUse | None = None,
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

    calls = {choice.index: tools.stream() for choice in choices} if tools is not None else {}
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
                reason = stream.finish(u.output).finish_reason
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

