"""``GET /v1/models`` and ``GET /v1/models/{model}``: the names this server answers to.

Every name given to ``--served-model-name`` is one card whose ``root`` is the first (main)
name: the same weights under each, and responses name the main one.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.checks import check_auth, check_model
from server.state import ServerState


async def list_models(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    cards = [_card(state, name) for name in state.config.names]
    return JSONResponse({"object": "list", "data": cards})


async def show_model(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    name = request.path_params["model"]
    check_model(name, state.config.names)
    return JSONResponse(_card(state, name))


def _card(state: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "radixkv",
        "root": state.config.model_name,
        "max_model_len": state.engine.max_context,
    }
