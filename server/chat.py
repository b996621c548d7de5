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

from engine import RequestOutput, TokenLogprob
from server import protocol
from server.errors import as_api_error
from server.generation import NO_USAGE, TokenBudget, envelope, parse, stream_usage, submit
from server.protocol import ChatRequest
from server.responses import chat_logprobs, usage_of
from server.state import ServerState
from server.streaming import Choice, EventStreamResponse, sse, updates, wait


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    req = await parse(state, request, ChatRequest)
    protocol.check_chat_only(req)
    messages = protocol.conversation(req.messages)
    ids = await state.encode(messages, "messages", [m["content"] for m in messages])
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
    )
    choices = submit(state, [ids], ["messages"], params, budget, req.cache_salt, req.stream)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        return EventStreamResponse(_stream(state, rid, req, choices))
    outputs = await wait(state, request, choices)
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    items = [
        _item(
            state,
            req,
            c,
            {"role": "assistant", "content": o.text},
            o.token_ids,
            o.logprobs or [],
            o.finish_reason,
            key="message",
        )
        for c, o in zip(choices, outputs)
    ]
    body = envelope(state, rid, "chat.completion", int(time.time()), items, usage_of([outputs]))
    if req.return_token_ids:
        body["prompt_token_ids"] = ids
    return JSONResponse(body)


def _item(
    state: ServerState,
    req: ChatRequest,
    choice: Choice,
    message: dict[str, str],
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
    state: ServerState, rid: str, req: ChatRequest, choices: list[Choice]
) -> AsyncIterator[bytes]:
    """The role chunk of every choice, a chunk per delta, the usage chunk if asked, [DONE];
    an error after the first byte is sent in-band (the status line is long gone)."""
    created = int(time.time())
    with_usage = stream_usage(req)
    per_chunk = None if with_usage else NO_USAGE  # OpenAI: "usage": null on every chunk

    def chunk(item: dict[str, Any]) -> bytes:
        return sse(envelope(state, rid, "chat.completion.chunk", created, [item], per_chunk))

    outputs: list[RequestOutput] = []
    try:
        for choice in choices:
            role = {"role": "assistant", "content": ""}
            yield chunk(_item(state, req, choice, role, [], [], None))
        async for u in updates(state, choices):
            delta = {"content": u.text} if u.output is None else {}
            reason = None if u.output is None else u.output.finish_reason
            yield chunk(_item(state, req, u.choice, delta, u.token_ids, u.logprobs, reason))
            if u.output is not None:
                outputs.append(u.output)
        if with_usage:
            usage = usage_of([outputs])
            yield sse(envelope(state, rid, "chat.completion.chunk", created, [], usage))
    except Exception as exc:
        yield sse(as_api_error(exc).body())
    yield sse("[DONE]")
