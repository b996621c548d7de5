"""``/v1/conversations``: create, retrieve, update (metadata) and delete a conversation; list,
add, retrieve and delete its items. The tenant is the ``cache_salt`` (in the body of a
``POST``, else a query parameter), as for stored responses: another tenant's conversation is a
404 as if it did not exist. Items are checked and shaped as ``/v1/responses`` checks and lists
its input (``shapes.input_messages``, ``shapes.as_items``): text parts only, each item with an
id, nothing kept that a later turn would not use."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server import protocol
from server.checks import check_auth, read_body
from server.conversations.store import Conversation, ConversationStoreFull
from server.errors import APIError, invalid, not_found
from server.listing import page_body, page_query
from server.responses import shapes
from server.state import ServerState

MAX_ITEMS_PER_REQUEST = 20  # OpenAI's bound on items added in one request


class CreateConversation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    items: list[Any] = []
    metadata: dict[str, str] | None = None
    cache_salt: str | None = None


class UpdateConversation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    metadata: dict[str, str]
    cache_salt: str | None = None


class AddItems(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    items: list[Any]
    cache_salt: str | None = None


async def create_conversation(state: ServerState, request: Request) -> Response:
    req = await _body(state, request, CreateConversation)
    shapes.check_metadata(req.metadata)
    items = checked_items(req.items, allow_empty=True)
    conversation = Conversation(shapes.new_id("conv"), int(time.time()), req.metadata or {})
    await _write(state.conversations.create, conversation, _salt(request, req), items)
    return JSONResponse(conversation.body())


async def get_conversation(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    conversation = await asyncio.to_thread(
        state.conversations.get, _id(request), _salt(request)
    )
    if conversation is None:
        raise no_such(_id(request))
    return JSONResponse(conversation.body())


async def update_conversation(state: ServerState, request: Request) -> Response:
    req = await _body(state, request, UpdateConversation)
    shapes.check_metadata(req.metadata)
    conversation = await asyncio.to_thread(
        state.conversations.update, _id(request), _salt(request, req), req.metadata
    )
    if conversation is None:
        raise no_such(_id(request))
    return JSONResponse(conversation.body())


async def delete_conversation(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    conversation_id, tenant = _id(request), _salt(request)
    conversations = state.conversations
    pinned = await asyncio.to_thread(conversations.last_turn_ids, conversation_id, tenant)
    if not await asyncio.to_thread(conversations.delete, conversation_id, tenant):
        raise no_such(conversation_id)
    if pinned:  # its last turn's tokens need not stay warm for a next turn any more
        state.engine.unpin_prefix(pinned, tenant or None)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted",
                         "deleted": True})


async def add_items(state: ServerState, request: Request) -> Response:
    req = await _body(state, request, AddItems)
    items = checked_items(req.items)
    if not await _write(state.conversations.add_items, _id(request), _salt(request, req), items):
        raise no_such(_id(request))
    return JSONResponse(page_body(items, has_more=False))


async def list_items(state: ServerState, request: Request) -> Response:
    """OpenAI's cursor page (``server.listing``)."""
    check_auth(request, state.config.api_key)
    asked = page_query(request)
    try:
        found = await asyncio.to_thread(
            state.conversations.page, _id(request), _salt(request), asked.order, asked.after,
            asked.limit,
        )
    except KeyError:
        raise invalid(f"after: no item {asked.after!r} in this conversation",
                      param="after") from None
    if found is None:
        raise no_such(_id(request))
    page, more = found
    return JSONResponse(page_body(page, has_more=more))


async def get_item(state: ServerState, request: Request) -> Response:
    check_auth(request, state.config.api_key)
    conversations = state.conversations
    conversation_id, item_id = _id(request), request.path_params["item_id"]
    item = await asyncio.to_thread(conversations.item, conversation_id, _salt(request), item_id)
    if item is None:
        raise _no_item(request)
    return JSONResponse(item)


async def delete_item(state: ServerState, request: Request) -> Response:
    """Removes one item; returns the conversation, as OpenAI does."""
    check_auth(request, state.config.api_key)
    conversations, tenant = state.conversations, _salt(request)
    conversation_id, item_id = _id(request), request.path_params["item_id"]
    if not await asyncio.to_thread(conversations.delete_item, conversation_id, tenant, item_id):
        raise _no_item(request)
    conversation = await asyncio.to_thread(conversations.get, conversation_id, tenant)
    if conversation is None:  # deleted in between
        raise no_such(conversation_id)
    return JSONResponse(conversation.body())


# ---------------------------------------------------------------------- shared with responses


def checked_items(given: list[Any], field: str = "items",
                  allow_empty: bool = False) -> list[dict[str, Any]]:
    """Items as ``/v1/responses`` takes them (a 400 naming ``items[i]...``), shaped and with
    ids, at most ``MAX_ITEMS_PER_REQUEST``."""
    if len(given) > MAX_ITEMS_PER_REQUEST:
        raise invalid(f"{field}: at most {MAX_ITEMS_PER_REQUEST} items per request, got "
                      f"{len(given)}", param=field)
    if not given:
        if allow_empty:
            return []
        raise invalid(f"{field}: empty list; expected at least one item", param=field)
    shapes.input_messages(given, field)
    return shapes.as_items(given)


def no_such(conversation_id: str, param: str | None = None) -> APIError:
    return not_found(
        f"conversation {conversation_id!r}: no such conversation (never created, deleted, or "
        "another tenant's: give its cache_salt)",
        code="conversation_not_found", param=param,
    )


def store_full(exc: ConversationStoreFull, field: str) -> APIError:
    return invalid(f"{field}: {exc}", param=field, code="conversation_store_full")


async def _write(call: Any, *args: Any) -> Any:
    try:
        return await asyncio.to_thread(call, *args)
    except ConversationStoreFull as exc:
        raise store_full(exc, "items") from None
    except ValueError as exc:  # an item id given twice
        raise invalid(f"items: {exc}", param="items") from None


async def _body(state: ServerState, request: Request, kind: type[Any]) -> Any:
    body = await read_body(request, state.config.max_body_bytes)
    check_auth(request, state.config.api_key)
    return protocol.decode_body(body, kind)


def _id(request: Request) -> str:
    return str(request.path_params["conversation_id"])


def _salt(request: Request, body: Any = None) -> str:
    salt = getattr(body, "cache_salt", None) if body is not None else None
    return salt or request.query_params.get("cache_salt") or ""


def _no_item(request: Request) -> APIError:
    item_id = request.path_params["item_id"]
    return not_found(
        f"item {item_id!r}: no such item in conversation {_id(request)!r} (or no such "
        "conversation of this tenant)",
        code="item_not_found",
    )
