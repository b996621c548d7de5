"""OpenAI's cursor pages (a stored response's input items, a conversation's items): the query
(``order`` desc by default, ``limit`` 1-100 (20), ``after`` an item id) and the list body."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request

from server.errors import invalid


class PageQuery(msgspec.Struct, frozen=True):
    order: str
    limit: int
    after: str | None


def page_query(request: Request) -> PageQuery:
    """The page a list request asks for; a 400 naming the query parameter otherwise."""
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"order: expected 'asc' or 'desc', got {order!r}", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid(f"limit: expected an integer in [1, 100], got {query.get('limit')!r}",
                      param="limit")
    return PageQuery(order, limit, query.get("after"))


def page_body(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page as OpenAI returns it."""
    return {"object": "list", "data": items, "has_more": has_more,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None}
