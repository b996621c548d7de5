"""``POST /v1/completions`` (OpenAI's legacy endpoint): one or many prompts (text or token
ids) in, ``n`` continuations of each out, whole or streamed as ``text_completion`` events.

Choice ``p * n + j`` is prompt ``p``'s ``j``-th; the usage counts each prompt once however
many choices ran on it. ``max_tokens`` defaults to 16, as OpenAI's does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.api import PromptIds, RequestOutput, TokenLogprob
from server import protocol
from server.errors import as_api_error
from server.generation import TokenBudget, parse, submit
from server.openai import records
from server.openai.bodies import (
    NO_USAGE,
    completion_logprobs,
    envelope,
    stream_usage,
    usage_of,
    vllm_prompt_logprobs,
)
from server.openai.records import CompletionRequest
from server.state import ServerState
from server.streaming import Choice, EventStreamResponse, Update, sse, updates, wait

# OpenAI's legacy completions default; chat completions default to the rest of the context.
DEFAULT_MAX_TOKENS = 16


async def create_completion(state: ServerState, request: Request) -> Response:
    req = await parse(state, request, CompletionRequest)
    records.check_completion_only(req)
    prompts = records.completion_prompts(req.prompt)
    fields = [f"prompt[{i}]" if len(prompts) > 1 else "prompt" for i in range(len(prompts))]
    encoded = [
        await state.encode(p, f, [p] if isinstance(p, str) else [])
        for p, f in zip(prompts, fields)
    ]
    keep = req.truncate_prompt_tokens  # cut by the engine's rule (echo tells cut from whole)
    token_ids = encoded if keep is None else [
        state.engine.encode(ids, f, truncate_prompt_tokens=keep)  # ids: taken as they are
        for ids, f in zip(encoded, fields)
    ]
    asked = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    # max_tokens 0 with echo scores the prompt only: one token is generated and dropped.
    budget = TokenBudget("max_tokens", max(asked, 1))
    scored = [c for c in (_echo_scores(req), req.prompt_logprobs) if c is not None]
    params = protocol.choice_params(
        req, max(asked, 1), req.logprobs, renames={"max_new_tokens": "max_tokens"},
        structure=records.structured_outputs(req),
        prompt_logprobs=max(scored) if scored else None,
    )
    if scored:  # a prompt's scores are the same for each choice: its first computes them
        params = params[:1] + [msgspec.structs.replace(p, prompt_logprobs=None)
                               for p in params[1:]]
    echo = [
        _echo_text(state, p, ids, len(ids) == len(full)) if req.echo else ""
        for p, ids, full in zip(prompts, token_ids, encoded)
    ]
    choices = submit(state, token_ids, fields, params, budget, req.cache_salt, req.stream)
    rid = f"cmpl-{uuid.uuid4().hex}"
    if req.stream:
        return EventStreamResponse(_stream(state, rid, req, choices, echo, token_ids))
    outputs = await wait(state, request, choices)
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    if asked == 0:
        outputs = [_without_generated(out) for out in outputs]
    scores = {c.prompt: out.prompt_logprobs for c, out in zip(choices, outputs)
              if out.prompt_logprobs is not None}
    items = []
    for choice, out in zip(choices, outputs):
        ids = token_ids[choice.prompt]
        item, offset = _prompt_item(state, req, choice, echo[choice.prompt], ids,
                                    scores.get(choice.prompt))
        prompt_part = item
        item = _item(state, req, choice, item["text"] + out.text, out.token_ids,
                     out.logprobs or [], offset, out.finish_reason, item["logprobs"])[0]
        if "prompt_logprobs" in prompt_part:
            item["prompt_logprobs"] = prompt_part["prompt_logprobs"]
        if req.return_token_ids:
            item["prompt_token_ids"] = ids
        items.append(item)
    usage = usage_of(_by_prompt(outputs, req.n))
    return JSONResponse(envelope(state, rid, "text_completion", int(time.time()), items, usage))


def _echo_scores(req: CompletionRequest) -> int | None:
    """Alternatives per prompt token that ``echo`` with ``logprobs`` shows (None: none)."""
    return req.logprobs if req.echo else None


def _without_generated(out: RequestOutput) -> RequestOutput:
    """An output of ``max_tokens`` 0: the prompt only (its one generated token dropped)."""
    return msgspec.structs.replace(
        out, text="", token_ids=[], logprobs=[] if out.logprobs is not None else None,
        finish_reason="length" if out.finish_reason != "abort" else "abort", tool_calls=None,
    )


def _by_prompt(outputs: list[RequestOutput], n: int) -> list[list[RequestOutput]]:
    """Outputs in choice order, grouped by prompt (choice p * n + j is prompt p's j-th)."""
    return [outputs[i : i + n] for i in range(0, len(outputs), n)]


def _echo_text(state: ServerState, prompt: str | list[int], ids: PromptIds, whole: bool) -> str:
    """The prompt as sent, or its ids' text where it came as ids or was truncated (``whole``
    False: ``ids`` are the tokens ``truncate_prompt_tokens`` kept)."""
    return prompt if isinstance(prompt, str) and whole else state.engine.tokenizer.decode(ids)


def _item(
    state: ServerState,
    req: CompletionRequest,
    choice: Choice,
    text: str,
    ids: list[int],
    lps: list[TokenLogprob],
    offset: int,
    reason: str | None,
    before: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], int]:
    """A completion choice, and the text offset after its tokens (a stream goes on there);
    ``before``: the echoed prompt's log-probabilities, which these tokens' follow."""
    item: dict[str, Any] = {
        "index": choice.index,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
    }
    if req.logprobs is not None:
        body, offset = completion_logprobs(lps, state.texts, offset)
        if before is not None:
            body = {key: before[key] + body[key] for key in body}
        item["logprobs"] = body
    if req.return_token_ids:
        item["token_ids"] = ids
    return item, offset


def _prompt_item(
    state: ServerState,
    req: CompletionRequest,
    choice: Choice,
    echo: str,
    ids: PromptIds,
    scores: list[TokenLogprob | None] | None,
) -> tuple[dict[str, Any], int]:
    """The part of a choice that is about its prompt: the echoed text, its tokens'
    log-probabilities when echo asked for them (OpenAI's: the first one null) and vLLM's
    ``prompt_logprobs`` when asked; and the text offset where the generated tokens begin."""
    item: dict[str, Any] = {"index": choice.index, "text": echo, "logprobs": None}
    offset = 0
    count = _echo_scores(req)
    if count is not None and scores is not None:
        item["logprobs"], offset = completion_logprobs(
            scores, state.texts, 0, token_ids=list(ids), top_n=count
        )
    elif req.echo:
        offset = len(echo)
    if req.prompt_logprobs is not None and scores is not None:
        item["prompt_logprobs"] = vllm_prompt_logprobs(scores, state.texts, req.prompt_logprobs)
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
    scores_echo = _echo_scores(req) is not None
    score_only = req.max_tokens == 0
    scores: dict[int, list[TokenLogprob | None]] = {}  # prompt -> its scores, once they came
    held: dict[int, list[Update]] = {}  # prompt -> its other choices' updates until then

    def emit(u: Update) -> Iterator[bytes]:
        if scores_echo and u.choice.index not in started:  # echo first
            item, offsets[u.choice.index] = _prompt_item(
                state, req, u.choice, echo[u.choice.prompt], prompt_ids[u.choice.prompt],
                scores[u.choice.prompt],
            )
            item["finish_reason"] = None
            if req.return_token_ids:
                item["token_ids"] = []
                item["prompt_token_ids"] = prompt_ids[u.choice.prompt]
            started.add(u.choice.index)
            yield sse(envelope(state, rid, "text_completion", created, [item], per_chunk))
        output = u.output
        if score_only:
            if output is None:
                return
            output = _without_generated(output)
            u = Update(u.choice, "", [], [], output)
        reason = None if output is None else output.finish_reason
        yield chunk(u.choice, u.text, u.token_ids, u.logprobs, reason)
        if output is not None:
            outputs[u.choice.index] = output

    try:
        if req.echo and not scores_echo:
            for choice in choices:
                yield chunk(choice, echo[choice.prompt], [], [], None)
                offsets[choice.index] = len(echo[choice.prompt])
        async for got in updates(state, choices):
            ready = [got]
            if scores_echo:  # a prompt's first choice scores it (its first update brings them)
                p = got.choice.prompt
                if got.prompt_logprobs is not None:
                    scores[p] = got.prompt_logprobs
                if p not in scores:
                    held.setdefault(p, []).append(got)
                    continue
                ready = held.pop(p, []) + ready
            for u in ready:
                for data in emit(u):
                    yield data
        if with_usage:
            usage = usage_of(_by_prompt([outputs[c.index] for c in choices], req.n))
            yield sse(envelope(state, rid, "text_completion", created, [], usage))
    except Exception as exc:
        yield sse(as_api_error(exc).body())
    yield sse("[DONE]")
