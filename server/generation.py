"""The steps the generation endpoints (chat completions, completions, responses) share:
reading a request, its token budget, submitting its choices.

The server checks here only what the engine cannot know (the key, the model name, the queue);
the prompt, the sampling fields and the context fit are checked by the engine, once, and its
errors are said in the request's words: ``submit`` maps a ``ContextLengthError`` to OpenAI's
``context_length_exceeded`` naming the request's prompt field and budget field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request

from engine import SamplingParams
from engine.api import ContextLengthError, PromptIds
from server import access_log, protocol
from server.checks import check_auth, check_model, check_queue, read_body
from server.errors import APIError, from_engine, invalid
from server.protocol import SamplingFields
from server.streaming import Choice

if TYPE_CHECKING:
    from server.state import ServerState

RequestT = TypeVar("RequestT", bound=SamplingFields)


async def parse(state: ServerState, request: Request, kind: type[RequestT]) -> RequestT:
    """The body (413 past the limit), the key, the body as ``kind``, the model it names and
    the features every generation endpoint refuses, in that order."""
    body = await read_body(request, state.config.max_body_bytes)
    check_auth(request, state.config.api_key)
    req = protocol.decode_body(body, kind)
    check_model(req.model, state.config.names)
    protocol.check_unsupported(req)
    return req


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """The tokens a request may generate, as the client asked: ``field`` names the field it
    used (``max_tokens``, ``max_completion_tokens``), ``asked`` its value, or None for the
    rest of the context (chat's default)."""

    field: str
    asked: int | None

    def tokens(self, prompt_len: int, context: int) -> int:
        """``max_new_tokens`` for a prompt of ``prompt_len`` tokens: what was asked, or the
        rest of the context (at least 1: a prompt that fills the context is the engine's
        ``ContextLengthError``, said by ``too_long``)."""
        return self.asked if self.asked is not None else max(context - prompt_len, 1)

    def too_long(self, exc: ContextLengthError, where: str) -> APIError:
        """The engine's context-fit error in the server's words: 400
        ``context_length_exceeded`` naming ``where``, the request's prompt field (over the
        model's context, or over what the KV pool holds for one request)."""
        prompt = exc.prompt_tokens
        context = exc.context
        whose = (
            "this server's KV cache holds" if exc.of_pool
            else "this model's maximum context length is"
        )
        if self.asked is None:
            message = (
                f"{where}: {whose} {context} tokens for one request, and the prompt has "
                f"{prompt}; shorten it"
            )
        else:
            message = (
                f"{where}: {whose} {context} tokens for one request; the request asks for "
                f"{prompt + exc.max_new_tokens} ({prompt} in the prompt, "
                f"{exc.max_new_tokens} for {self.field}); shorten the prompt or lower "
                f"{self.field}"
            )
        return invalid(message, param=where, code="context_length_exceeded")


def submit(
    state: ServerState,
    prompts: Sequence[PromptIds],
    fields: Sequence[str],
    params: Sequence[SamplingParams],
    budget: TokenBudget,
    namespace: str | None,
    stream: bool,
    renames: Mapping[str, str] | None = None,
    pin_ttl: float | None = None,
) -> list[Choice]:
    """Queues ``len(params)`` choices per prompt, all or nothing (what was queued is aborted
    if one fails). The ids go to the engine exactly as ``encode`` returned them, so they are
    not checked again; the engine checks what depends on the params (the stop ids against
    the vocabulary, the context fit), and its errors name ``fields[p]`` for prompt ``p``,
    and a field the request calls otherwise by the request's name (``renames``: the engine's
    name -> the request's). ``pin_ttl``: each finished choice's tokens stay pinned that long
    (a stored conversation)."""
    check_queue(state, len(prompts) * len(params))
    choices: list[Choice] = []
    try:
        for p, ids in enumerate(prompts):
            for j, sampling in enumerate(params):
                try:
                    handle = state.engine.submit(
                        ids, sampling, namespace, stream=stream, pin_ttl=pin_ttl
                    )
                except ContextLengthError as exc:
                    raise budget.too_long(exc, fields[p]) from None
                except ValueError as exc:  # the engine's namespace is the request's salt
                    raise from_engine(
                        exc, {"namespace": "cache_salt", **(renames or {})}
                    ) from None
                choices.append(Choice(p * len(params) + j, p, handle))
    except BaseException:
        for choice in choices:
            choice.handle.abort()
        raise
    access_log.count(prompt=sum(map(len, prompts)))  # each prompt once, as usage counts it
    return choices
