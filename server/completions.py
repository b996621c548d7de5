"""``POST /v1/completions`` (OpenAI's legacy endpoint): one or many prompts (text or token
ids) in, ``n`` continuations of each out, whole or streamed as ``text_completion`` events.

Choice ``p * n + j`` is prompt ``p``'s ``j``-th; the usage counts each prompt once however
many choices ran on it. ``max_tokens`` defaults to 16, as OpenAI's does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import PromptIds, RequestOutput, TokenLogprob
from server import protocol
from server.errors import as_api_error
from server.generation import NO_USAGE, TokenBudget, envelope, parse, stream_usage, submit
from server.protocol import CompletionRequest
from server.responses import completion_logprobs, usage_of
from server.state import ServerState
from server.streaming import Choice, EventStreamResponse, sse, updates, wait

# OpenAI's legacy completions default; chat completions default to the rest of the context.
DEFAULT_MAX_TOKENS = 16


async def create_completion(state: ServerState, request: Request) -> Response:
    req = await parse(state, request, CompletionRequest)
    protocol.check_completion_only(req)
    prompts = protocol.completion_prompts(req.prompt)
    fields = [f"prompt[{i}]" if len(prompts) > 1 else "prompt" for i in range(len(prompts))]
    token_ids = [
        await state.encode(p, f, [p] if isinstance(p, str) else [])
        for p, f in zip(prompts, fields)
    ]
    asked = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    budget = TokenBudget("max_tokens", asked)
    params = protocol.choice_params(
        req, asked, req.logprobs, renames={"max_new_tokens": "max_tokens"},
        structure=protocol.structured_outputs(req),
    )
    echo = [_echo_text(state, p, ids) if req.echo else "" for p, ids in zip(prompts, token_ids)]
    choices = submit(state, token_ids, fields, params, budget, req.cache_salt, req.stream)
    rid = f"cmpl-{uuid.uuid4().hex}"
    if req.stream:
        return EventStreamResponse(_stream(state, rid, req, choices, echo, token_ids))
    outputs = await wait(state, request, choices)
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    items = []
    for choice, out in zip(choices, outputs):
        item = _item(
            state,
            req,
            choice,
            echo[choice.prompt] + out.text,
            out.token_ids,
            out.logprobs or [],
            0,
            out.finish_reason,
        )[0]
        if req.return_token_ids:
            item["prompt_token_ids"] = token_ids[choice.prompt]
        items.append(item)
    usage = usage_of(_by_prompt(outputs, req.n))
    return JSONResponse(envelope(state, rid, "text_completion", int(time.time()), items, usage))


def _by_prompt(outputs: list[RequestOutput], n: int) -> list[list[RequestOutput]]:
    """Outputs in choice order, grouped by prompt (choice p * n + j is prompt p's j-th)."""
    return [outputs[i : i + n] for i in range(0, len(outputs), n)]


def _echo_text(state: ServerState, prompt: str | list[int], ids: PromptIds) -> str:
    return prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(ids)


def _item(
    state: ServerState,
    req: CompletionRequest,
    choice: Choice,
    text: str,
    ids: list[int],
    lps: list[TokenLogprob],
    offset: int,
    reason: str | None,
) -> tuple[dict[str, Any], int]:
    """A completion choice, and the text offset after its tokens (a stream goes on there)."""
    item: dict[str, Any] = {
        "index": choice.index,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
    }
    if req.logprobs is not None:
        item["logprobs"], offset = completion_logprobs(lps, state.texts, offset)
    if req.return_token_ids:
        item["token_ids"] = ids
    return item, offset


async def _stream(
    state: ServerState,
    rid: str,
    req: CompletionRequest,
    choices: list[Choice],
    echo: list[str],
    prompt_ids: list[PromptIds],
) -> AsyncIterator[bytes]:
    """The echoed prompts if asked, a chunk per delta (a choice's first one carries its
    prompt's ids when asked), the usage chunk if asked, [DONE]; errors in-band."""
    created = int(time.time())
    with_usage = stream_usage(req)
    per_chunk = None if with_usage else NO_USAGE
    offsets = {c.index: 0 for c in choices}
    started: set[int] = set()

    def chunk(
        choice: Choice, text: str, ids: list[int], lps: list[TokenLogprob], reason: str | None
    ) -> bytes:
        item, offsets[choice.index] = _item(
            state, req, choice, text, ids, lps, offsets[choice.index], reason
        )
        if req.return_token_ids and choice.index not in started:
            item["prompt_token_ids"] = prompt_ids[choice.prompt]
        started.add(choice.index)
        return sse(envelope(state, rid, "text_completion", created, [item], per_chunk))

    outputs: dict[int, RequestOutput] = {}
    try:
        if req.echo:
            for choice in choices:
                yield chunk(choice, echo[choice.prompt], [], [], None)
        async for u in updates(state, choices):
            reason = None if u.output is None else u.output.finish_reason
            yield chunk(u.choice, u.text, u.token_ids, u.logprobs, reason)
            if u.output is not None:
                outputs[u.choice.index] = u.output
        if with_usage:
            usage = usage_of(_by_prompt([outputs[c.index] for c in choices], req.n))
            yield sse(envelope(state, rid, "text_completion", created, [], usage))
    except Exception as exc:
        yield sse(as_api_error(exc).body())
    yield sse("[DONE]")
