"""What operators and orchestrators poll: ``GET /health`` (200 while the engine loop runs, 503
``engine_dead`` after) and ``GET /metrics`` (Prometheus text). Neither needs the API key: a
load balancer's probe and a scraper carry none."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.errors import engine_dead, overloaded
from server.metrics import CONTENT_TYPE
from server.state import ServerState


async def health(state: ServerState, request: Request) -> Response:
    if not state.engine.alive:
        return engine_dead("the engine loop is not running").response()
    if state.draining:  # a load balancer's cue to send no more
        return overloaded("shutting down", code="shutting_down").response()
    return JSONResponse({"status": "ok"})


async def metrics(state: ServerState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
