"""Errors as OpenAI's API returns them: ``{"error": {"message", "type", "param", "code"}}``.

Clients (the ``openai`` package, LangChain, curl scripts) branch on the status and read the
message, so every failure the server knows of becomes one of these, never a traceback.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from starlette.responses import JSONResponse

from engine.api import EngineDeadError
from server.responses.store import StoreUnavailable

log = logging.getLogger("radixkv.server")

# "max_tokens: must be ..." -> param "max_tokens"; "messages[2].content: ..." -> that path.
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


@dataclass
class APIError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, dict[str, str | None]]:
        # ``code`` is a string or null, as OpenAI's is (clients type it so); the status is
        # the HTTP response's own.
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for bad input; ``param`` defaults to the field the message starts with."""
    if param is None:
        found = _FIELD.match(message)
        param = found.group(1) if found else None
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> APIError:
    return APIError(404, message, type="not_found_error", param=param, code=code)


def too_large(message: str) -> APIError:
    return APIError(413, message, code="request_too_large")


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
        type="authentication_error",
        code="invalid_api_key",
    )


def overloaded(message: str, retry_after_s: int = 1, code: str = "queue_full") -> APIError:
    return APIError(
        503,
        message,
        type="service_unavailable_error",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def client_gone() -> APIError:
    """The client left before its request was read (499, nginx's "client closed request"):
    an answer nobody reads, and nothing for the log."""
    return APIError(499, "the client closed the connection before sending its whole request")


def engine_dead(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code="engine_dead")


def store_unavailable(exc: StoreUnavailable) -> APIError:
    """A store's file unusable (damaged, gone, a full disk): the server's failure and not the
    request's, and not all of the server's (503; the code names the store)."""
    return APIError(503, str(exc), type="service_unavailable_error", code=exc.code)


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


# The engine names a request's sampling fields under ``params.`` (its argument); an HTTP
# request has them at the top level of its body.
_PARAMS = "params."


def from_engine(exc: ValueError, renames: Mapping[str, str] | None = None) -> APIError:
    """The engine's ValueError (bad input: the client's fault) as a 400 naming the field as
    the client spelled it: ``params.`` dropped, and an engine field that the request calls
    otherwise renamed (``max_new_tokens`` -> ``max_tokens``, ``logprobs`` ->
    ``top_logprobs``)."""
    message = str(exc).removeprefix(_PARAMS)
    found = _FIELD.match(message)
    if renames and found and found.group(1) in renames:
        message = renames[found.group(1)] + message[len(found.group(1)) :]
    return invalid(message)


def as_api_error(exc: BaseException) -> APIError:
    """Any failure as OpenAI's error: the engine's ValueErrors are the client's fault, a
    stopped engine or an unusable store is a 503, anything else a 500 whose details stay in the log."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead(str(exc))
    if isinstance(exc, StoreUnavailable):  # logged by the store when it first failed
        return store_unavailable(exc)
    if isinstance(exc, ValueError):
        return from_engine(exc)
    log.error("request failed", exc_info=exc)
    # An exception's text can carry internals (paths, Ray's actor ids and node addresses)
    # that a client must not see.
    return internal("the request failed inside the server (its log has the details); retry")
