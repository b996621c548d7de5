"""One access line per HTTP request: method, path, status, time and tokens.

Why ours and not uvicorn's: uvicorn's line has no time or token counts, and Ray Serve's front
has its own format; this one is the same under both. It never holds the body, the query
string or a header: prompts and keys are tenants' data, and a log is read by more people than
the requests were meant for. The endpoints count the request's tokens as they go (``count``),
into a record that this middleware puts in the request's context: a stream's task inherits
that context, so its tokens land in the same record.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("radixkv.access")


class RequestTokens(msgspec.Struct):
    """The tokens one HTTP request ran: its prompts (each once) and everything generated."""

    prompt: int = 0
    completion: int = 0


_current: ContextVar[RequestTokens | None] = ContextVar("radixkv_request_tokens", default=None)


def count(prompt: int = 0, completion: int = 0) -> None:
    """Adds to the current request's tokens (nothing outside a logged request)."""
    tokens = _current.get()
    if tokens is not None:
        tokens.prompt += prompt
        tokens.completion += completion


class AccessLog:
    """ASGI middleware: after each HTTP request's response has gone out (a stream's last
    chunk included), one INFO line on ``radixkv.access``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tokens = RequestTokens()
        reset = _current.set(tokens)
        status = 0
        started = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            status = status or 500  # what the error boundary outside answers
            raise
        finally:
            _current.reset(reset)
            log.info(
                "%s %s %d %.3fs prompt_tokens=%d completion_tokens=%d",
                scope.get("method", "?"),
                _printable(scope.get("path", "?")),
                status or 499,  # nothing answered: the client left first
                time.perf_counter() - started,
                tokens.prompt,
                tokens.completion,
            )


def _printable(path: str, limit: int = 200) -> str:
    """The path as one line of the log: a decoded ``%0a`` must not forge a line."""
    shown = "".join(c if c.isprintable() else "?" for c in path[:limit])
    return shown + ("..." if len(path) > limit else "")
