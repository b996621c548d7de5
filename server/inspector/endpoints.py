"""The cache inspector over HTTP: ``GET /inspect`` (the page) and ``GET /inspect/state``.

The page is three static files of this package (``server/inspector/static``: HTML, CSS, JS; no build
step, nothing fetched from elsewhere, a Content-Security-Policy that forbids it) that poll
the state. The state is the engines' ``InspectSnapshot``s (taken on each loop thread, bounded
by ``?budget=`` nodes; with replicas, the snapshots they published last) made into JSON by
``view`` on the tokenizing thread, plus the traffic of the last minutes.

Both answer only clients on loopback unless the server runs with ``--inspect-public``; the
state needs the API key as the API does (the page holds no data, and a browser cannot send a
bearer header when it opens a URL). Tenants' text is shown only to a viewer who sends their
``cache_salt`` in ``X-Radixkv-Cache-Salts`` (comma-separated, each base64url of its UTF-8).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import functools
import ipaddress
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from server.checks import check_auth
from server.errors import APIError, engine_dead, invalid, not_found
from server.inspector.view import build_state, label_sources, summed
from server.state import ServerState

DEFAULT_BUDGET = 400
MAX_BUDGET = 20_000
SNAPSHOT_TIMEOUT_S = 10.0
SALTS_HEADER = "x-radixkv-cache-salts"
# Nothing but this server: no CDN, no inline script (a label can never become code).
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# budget -> {engine or replica name: InspectSnapshot}
SnapshotSource = Callable[[int], Mapping[str, Any]]
STATIC = {
    "inspect.html": "text/html; charset=utf-8",
    "inspect.css": "text/css; charset=utf-8",
    "inspect.js": "text/javascript; charset=utf-8",
}


@functools.cache
def static_file(name: str) -> bytes:
    return (resources.files("server.inspector") / "static" / name).read_bytes()


def check_reach(state: ServerState, request: Request) -> None:
    """Loopback clients only, unless the server was started with ``--inspect-public``."""
    if state.config.inspect_public:
        return
    host = request.client.host if request.client else ""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        address = None
    mapped = getattr(address, "ipv4_mapped", None)
    if address is None or not (mapped or address).is_loopback:
        raise APIError(
            403,
            "the inspector answers loopback clients only; start the server with "
            "--inspect-public to open it to others",
            type="permission_error",
            code="inspect_not_public",
        )


async def page(state: ServerState, request: Request) -> Response:
    """``/inspect`` and its two assets."""
    check_reach(state, request)
    name = request.path_params.get("asset", "inspect.html")
    if name not in STATIC:
        raise not_found(f"{request.url.path}: no such file", code="route_not_found")
    return Response(
        static_file(name),
        media_type=STATIC[name],
        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
                 "X-Content-Type-Options": "nosniff"},
    )


class Inspector:
    """``GET /inspect/state`` over a source of snapshots: by default the engine's own
    (``Engine.inspect``, taken now); the replicas' front passes the ones they posted."""

    def __init__(self, engine: Any, snapshots: SnapshotSource | None = None) -> None:
        take = getattr(engine, "inspect", None)
        if snapshots is None and callable(take):

            def snapshots(budget: int) -> Mapping[str, Any]:
                return {"engine": take(budget, timeout=SNAPSHOT_TIMEOUT_S)}

        self._snapshots = snapshots

    async def state(self, state: ServerState, request: Request) -> Response:
        """The state JSON (see ``view``)."""
        check_reach(state, request)
        check_auth(request, state.config.api_key)
        if self._snapshots is None:
            raise not_found("this engine cannot be inspected", code="inspect_unavailable")
        budget = _budget(request.query_params.get("budget"))
        salts = _salts(request.headers.get(SALTS_HEADER, ""))
        try:
            taken = await asyncio.to_thread(self._snapshots, budget)
        except (TimeoutError, concurrent.futures.TimeoutError):  # distinct before 3.11
            raise engine_dead("the engine did not answer the inspector in time") from None
        return await _state(state, dict(sorted(taken.items())), salts, budget)


async def _state(
    state: ServerState, snapshots: dict[str, Any], salts: frozenset[str], budget: int
) -> Response:
    stats = [s.stats for s in snapshots.values()]
    if stats:
        state.traffic.sample(summed(stats))
    runs = label_sources(snapshots, salts)
    labels = await state.on_tokenizer(state.engine.tokenizer.batch_decode, runs) if runs else []
    body = build_state(snapshots, salts, labels, state.traffic.series())
    body["budget"] = budget
    return Response(msgspec.json.encode(body), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


def _budget(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_BUDGET
    if not raw.isdigit() or not 0 <= int(raw) <= MAX_BUDGET:
        raise invalid(f"budget: must be an integer in [0, {MAX_BUDGET}], got {raw!r}")
    return int(raw)


def _salts(raw: str) -> frozenset[str]:
    """The viewer's cache salts from the header (base64url of UTF-8, comma-separated)."""
    salts = set()
    for part in filter(None, (p.strip() for p in raw.split(","))):
        try:
            raw_salt = base64.b64decode(part + "=" * (-len(part) % 4), b"-_", validate=True)
            salts.add(raw_salt.decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise invalid(
                f"{SALTS_HEADER}: {part[:40]!r} is not base64url of UTF-8 text",
                param=SALTS_HEADER,
            ) from None
    return frozenset(salts)
