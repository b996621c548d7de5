"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extensions): the token ids the engine
would run for a prompt or a conversation, and the text of token ids.

``/tokenize`` encodes exactly as the generation endpoints do (the same ``encode``, the same
checks, the chat template for messages, the tools' section beside ``tools``), so a client can
count a prompt's tokens before sending it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server import access_log, protocol
from server.checks import check_auth, check_model, read_body
from server.errors import invalid
from server.openai.records import DetokenizeRequest, TokenizeRequest
from server.state import ServerState


async def tokenize(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    body = await read_body(request, state.config.max_body_bytes)
    req = protocol.decode_body(body, TokenizeRequest)
    check_model(req.model, state.config.names)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("prompt: give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.tools is not None and req.messages is None:
        raise invalid("tools: only with 'messages' (they are rendered into the conversation)")
    if req.messages is not None:
        # rendered as the chat request renders it, tools included: the counts agree
        _, (messages, _) = protocol.tool_prompt(
            state.engine, protocol.conversation(req.messages), req.tools
        )
        ids = await state.encode(messages, "messages", [m["content"] for m in messages])
    else:
        if not isinstance(req.prompt, str):
            raise invalid(f"prompt: expected a string, got {type(req.prompt).__name__}")
        ids = await state.encode(req.prompt, "prompt", [req.prompt])
    access_log.count(prompt=len(ids))
    max_len = state.engine.max_context
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_len})


async def detokenize(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    body = await read_body(request, state.config.max_body_bytes)
    req = protocol.decode_body(body, DetokenizeRequest)
    check_model(req.model, state.config.names)
    return JSONResponse({"prompt": await state.decode(req.tokens, "tokens")})
