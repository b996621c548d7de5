"""The OpenAI-compatible HTTP app over one engine: ``create_app(engine, config)``.

Starlette, not FastAPI: the request bodies are decoded by msgspec (already the engine's record
library, and it names the failing field), errors must be OpenAI's JSON with status 400 where
FastAPI's validation answers 422 in its own shape, and the app stays a plain ASGI callable
that uvicorn serves and Ray Serve can mount. Every request runs on the event loop through the
engine's asyncio API (``RequestHandle.events``); no thread per request.

This module only wires routes to endpoints, one module each, by feature: OpenAI's chat
completions and completions and vLLM's beside them (``openai``: ``chat``, ``completions``,
``models``, ``tokenization``), the Responses API (``responses``) and its conversations
(``conversations``), the cache inspector (``inspector``) and the probes (``probes``), over one
``ServerState`` (``state``). They
share the checks before the body means anything (``checks``), the request fields
(``protocol``), the steps of generation (``generation``) and the following of engine
requests to the client (``streaming``); every request gets one access line (``access_log``)
unless the config turns it off. Before any route, every request meets the ``RequestGuard``
(``checks``): a ``Host`` naming this server, no other site's ``Origin``, a JSON body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.api import EngineClient
from server import probes
from server.access_log import AccessLog
from server.checks import RequestGuard
from server.config import ServerConfig
from server.conversations import endpoints as conversations
from server.errors import APIError, as_api_error, not_found
from server.inspector import endpoints as inspector
from server.openai import chat, completions, models, tokenization
from server.responses import endpoints as responses
from server.state import ServerState

Endpoint = Callable[[ServerState, Request], Awaitable[Response]]

__all__ = ["ServerConfig", "create_app"]


def create_app(
    engine: EngineClient,
    config: ServerConfig | None = None,
    snapshots: inspector.SnapshotSource | None = None,
) -> Starlette:
    """The OpenAI-compatible ASGI app over ``engine`` (an ``Engine``, or a ``RemoteEngine``
    in front of replicas); serve it with uvicorn, or mount it. ``snapshots``: where the
    inspector's snapshots come from (default: ``engine.inspect``; the replicas' front passes
    the ones they post)."""
    state = ServerState(engine, config or ServerConfig())
    inspector_state = inspector.Inspector(engine, snapshots)

    def api(path: str, endpoint: Endpoint, method: str) -> Route:
        """A route whose every failure is OpenAI's error JSON."""

        async def run(request: Request) -> Response:
            try:
                return await endpoint(state, request)
            except Exception as exc:
                return as_api_error(exc).response()

        return Route(path, run, methods=[method])

    def probe(path: str, endpoint: Endpoint) -> Route:
        async def run(request: Request) -> Response:
            return await endpoint(state, request)

        return Route(path, run, methods=["GET"])

    routes = [
        api("/v1/chat/completions", chat.create_chat_completion, "POST"),
        api("/v1/completions", completions.create_completion, "POST"),
        api("/v1/responses", responses.create_response, "POST"),
        api("/v1/responses/{response_id}", responses.get_response, "GET"),
        api("/v1/responses/{response_id}/input_items", responses.list_input_items, "GET"),
        api("/v1/responses/{response_id}", responses.delete_response, "DELETE"),
        api("/v1/conversations", conversations.create_conversation, "POST"),
        api("/v1/conversations/{conversation_id}", conversations.get_conversation, "GET"),
        api("/v1/conversations/{conversation_id}", conversations.update_conversation, "POST"),
        api("/v1/conversations/{conversation_id}", conversations.delete_conversation, "DELETE"),
        api("/v1/conversations/{conversation_id}/items", conversations.list_items, "GET"),
        api("/v1/conversations/{conversation_id}/items", conversations.add_items, "POST"),
        api("/v1/conversations/{conversation_id}/items/{item_id}", conversations.get_item,
            "GET"),
        api("/v1/conversations/{conversation_id}/items/{item_id}", conversations.delete_item,
            "DELETE"),
        api("/v1/models", models.list_models, "GET"),
        api("/v1/models/{model:path}", models.show_model, "GET"),
        api("/tokenize", tokenization.tokenize, "POST"),
        api("/detokenize", tokenization.detokenize, "POST"),
        probe("/health", probes.health),
        probe("/metrics", probes.metrics),
        api("/inspect", inspector.page, "GET"),
        api("/inspect/state", inspector_state.state, "GET"),
        api("/inspect/{asset}", inspector.page, "GET"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _unhandled},
        middleware=[
            *([Middleware(AccessLog)] if state.config.log_requests else []),
            Middleware(RequestGuard, allowed_hosts=state.config.allowed_hosts),
        ],
    )
    app.state.server = state
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) as OpenAI's error JSON."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = not_found(f"{request.url.path}: no such route", code="route_not_found")
    else:
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return error.response()


async def _unhandled(request: Request, exc: Exception) -> Response:
    return as_api_error(exc).response()
