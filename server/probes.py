"""What operators and orchestrators poll: ``GET /health`` (200 while the engine loop runs, 503
``engine_dead`` after) and ``GET /metrics`` (Prometheus text). Neither needs the API key: a
load balancer's probe and a scraper carry none.

A store whose file is unusable (damaged, removed, a full disk) leaves ``/health`` at 200 with
``"status": "degraded"`` and the store's ``status`` and ``message``: chat, completions and
``store: false`` still work, so a load balancer that reads only the status code keeps sending
them; one that should also keep stored conversations away from the server reads ``status``.
(A 503 would take all of the server out of rotation for what only some requests need, and a
restart would not mend a damaged file.)"""

from __future__ import annotations

import asyncio
from typing import Any

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
    stores = {"response_store": state.responses, "conversation_store": state.conversations}
    problems = await asyncio.to_thread(lambda: {k: s.health() for k, s in stores.items()})
    if not any(problems.values()):
        return JSONResponse({"status": "ok"})
    body: dict[str, Any] = {"status": "degraded"}
    for key, problem in problems.items():
        store = stores[key]
        body[key] = {"status": "ok", "file": store.path} if problem is None else {
            "status": "unavailable", "file": store.path,
            "message": f"the {store.name} {store.path} is unavailable: {problem}",
        }
    return JSONResponse(body)


async def metrics(state: ServerState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
