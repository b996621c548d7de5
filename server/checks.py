"""The checks a request meets before its body means anything: its size, its key, the model it
names and the room in the queue.

They are the server's own (the engine knows no HTTP, no keys, no queue limit), cheap, and run
before any tokenizing, so a refused request costs the server next to nothing.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from starlette.requests import ClientDisconnect, Request

from server.errors import client_gone, invalid, not_found, overloaded, too_large, unauthorized

if TYPE_CHECKING:
    from server.state import ServerState


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 past ``limit`` bytes (by its Content-Length when it has one, else
    while it streams in: a chunked upload is cut off at the limit, not read whole)."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else 0
    chunks = []
    if size <= limit:
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
        except ClientDisconnect:  # nobody to answer, and nothing went wrong here
            raise client_gone() from None
    if size > limit:
        raise too_large(f"the request body is over {limit} bytes (the server's --max-body-bytes)")
    return b"".join(chunks)


def check_auth(request: Request, api_key: str | None) -> None:
    """``Authorization: Bearer <api_key>``, compared in constant time (401 otherwise)."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    # bytes: compare_digest refuses str with non-ASCII characters (a header can hold them)
    sent = token.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, api_key.encode("utf-8")):
        raise unauthorized()


def check_model(model: str | None, names: list[str]) -> None:
    """A model the server answers to (or none named): 404 otherwise, as OpenAI's API."""
    if model is not None and model not in names:
        raise not_found(
            f"model: {model!r} does not exist; this server serves {names}",
            param="model",
            code="model_not_found",
        )


def check_queue(state: ServerState, adding: int) -> None:
    """Room for ``adding`` engine requests (prompts x n): a 400 if one HTTP request asks for
    more than any may, a 503 + Retry-After while the queue has no room for them."""
    config = state.config
    if state.draining:
        state.metrics.reject("shutting_down")
        raise overloaded("the server is shutting down; retry on another", code="shutting_down")
    if adding > config.max_choices:
        raise invalid(
            f"n: {adding} completions (prompts x n) in one request; at most "
            f"{config.max_choices}",
            param="n",
        )
    limit = config.max_queued
    if limit is None:
        return
    if adding > limit:
        raise invalid(
            f"n: {adding} completions (prompts x n) in one request can never wait in "
            f"this server's queue of {limit} (--max-queued); send fewer at a time",
            param="n",
        )
    waiting = state.engine.num_waiting()
    if waiting + adding > limit:
        state.metrics.reject("queue_full")
        raise overloaded(
            f"the server is busy: {waiting} requests already wait and the queue holds "
            f"{limit} (--max-queued); retry later"
        )
