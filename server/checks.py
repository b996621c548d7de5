"""The checks a request meets before its body means anything: who it is addressed to and
where it comes from (``RequestGuard``: Host, Origin, a JSON body), its size, its key, the
model it names and the room in the queue.

They are the server's own (the engine knows no HTTP, no keys, no queue limit), cheap, and run
before any tokenizing, so a refused request costs the server next to nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import (
    APIError,
    client_gone,
    invalid,
    not_found,
    overloaded,
    too_large,
    unauthorized,
)

if TYPE_CHECKING:
    from server.state import ServerState


def host_name(authority: str) -> str:
    """The name of a ``Host`` value (``host[:port]``, ``[v6][:port]``), lower case, an IPv6
    address without brackets, a trailing dot dropped."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    if authority.count(":") > 1:  # a bare IPv6 address (no port can be told apart)
        return authority
    return authority.partition(":")[0].rstrip(".")


def check_host(headers: Headers, allowed: Sequence[str] | None) -> None:
    """The ``Host`` header names this server (421 otherwise): a browser tricked into calling
    it under another name (DNS rebinding) sends that name. No header (HTTP/1.0; never a
    browser) passes."""
    if allowed is None or "*" in allowed or "host" not in headers:
        return
    given = headers["host"]
    if host_name(given) not in allowed:
        names = ", ".join(f"[{h}]" if ":" in h else h for h in allowed)
        raise APIError(
            421,
            f"Host: {given[:100]!r} is not a name of this server ({names}); a server bound "
            "to loopback answers only its loopback names unless started with "
            "--allowed-hosts NAME ...",
            code="host_not_allowed",
        )


def check_origin(headers: Headers) -> None:
    """A browser's ``Origin``, where it sends one, is this server's own (scheme://Host): 403
    for a page of another site (the server sends no CORS headers, so none may use it)."""
    origin = headers.get("origin")
    if origin is None:
        return
    host = headers.get("host", "").strip().lower()
    parts = urlsplit(origin.strip().lower()) if origin != "null" else None
    if parts is None or parts.scheme not in ("http", "https") or parts.netloc != host:
        raise APIError(
            403,
            f"Origin: {origin[:100]!r} is not this server's own ({host!r}); pages of other "
            "sites may not call it",
            type="permission_error",
            code="cross_origin",
        )


def check_json_body(method: str, headers: Headers) -> None:
    """A POST's body is ``application/json`` (415 otherwise): a browser sends a form or
    ``text/plain`` to another site without asking it first, JSON only after a preflight that
    this server does not answer."""
    if method != "POST":
        return
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(
            415,
            f"Content-Type: POST bodies must be application/json, got {media or 'none'!r}",
            code="unsupported_media_type",
        )


class RequestGuard:
    """ASGI middleware: every HTTP request meets ``check_host``, ``check_origin`` and
    ``check_json_body`` before it reaches a route; a refusal is OpenAI's error JSON."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str] | None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            try:
                check_host(headers, self.allowed_hosts)
                check_origin(headers)
                check_json_body(scope["method"], headers)
            except APIError as refused:
                await refused.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
