"""The cache inspector over HTTP: ``GET /inspect`` (the page) and ``GET /inspect/state``.

The page is three static files of this package (``server/inspector/static``: HTML, CSS, JS; no build
step, nothing fetched from elsewhere, a Content-Security-Policy that forbids it) that poll
the state. The state is the engines' ``InspectSnapshot``s (taken on each loop thread, bounded
by ``?budget=`` nodes; with replicas, the snapshots they published last), labelled on the
tokenizing thread and made into JSON by ``view`` on a worker thread, plus the traffic of the
last minutes. None of that runs on the event loop: 20,000 nodes made into JSON there held
every stream's next token for tens of milliseconds per poll. One inspection runs at a time;
a few more wait, and past those a 429 says to retry.

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
from server.inspector.view import build_state, label_runs, label_sources, summed
from server.state import ServerState

DEFAULT_BUDGET = 400
MAX_BUDGET = 20_000
SNAPSHOT_TIMEOUT_S = 10.0
# Inspections waiting for the one in progress beyond which a new one gets 429 + Retry-After.
MAX_WAITING_INSPECTIONS = 4
# Labels decoded per call on the tokenizing thread: the tokenizer decodes a batch holding the
# interpreter lock (20,000 labels in one call held it, and so the event loop, ~300 ms), and
# other requests' tokenizing waits behind each call.
LABELS_PER_DECODE = 256
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
        self._one_at_a_time = asyncio.Lock()
        self._waiting = 0

    async def state(self, state: ServerState, request: Request) -> Response:
        """The state JSON (see ``view``)."""
        check_reach(state, request)
        check_auth(request, state.config.api_key)
        if self._snapshots is None:
            raise not_found("this engine cannot be inspected", code="inspect_unavailable")
        budget = _budget(request.query_params.get("budget"))
        salts = _salts(request.headers.get(SALTS_HEADER, ""))
        if self._one_at_a_time.locked() and self._waiting >= MAX_WAITING_INSPECTIONS:
            raise APIError(
                429,
                f"the inspector is busy: one inspection runs and {self._waiting} wait; retry "
                "in a second",
                type="rate_limit_error",
                code="inspector_busy",
                headers={"Retry-After": "1"},
            )
        self._waiting += 1
        try:
            await self._one_at_a_time.acquire()
        finally:  # acquired, or cancelled while waiting (the client left)
            self._waiting -= 1
        try:
            return await self._state(state, salts, budget)
        finally:
            self._one_at_a_time.release()

    async def _state(self, state: ServerState, salts: frozenset[str], budget: int) -> Response:
        """Snapshots and their label sources, the labels, then the JSON: each off the loop."""
        assert self._snapshots is not None
        try:
            snapshots, runs = await asyncio.to_thread(_take, self._snapshots, budget, salts)
        except (TimeoutError, concurrent.futures.TimeoutError):  # distinct before 3.11
            raise engine_dead("the engine did not answer the inspector in time") from None
        stats = [s.stats for s in snapshots.values()]
        if stats:
            state.traffic.sample(summed(stats))
        labels: list[str] = []
        for start in range(0, len(runs), LABELS_PER_DECODE):
            labels += await state.on_tokenizer(
                _decoded, state.engine.tokenizer, runs[start : start + LABELS_PER_DECODE]
            )
        traffic = state.traffic.series()  # the log is the loop's: read here, not on a thread
        body = await asyncio.to_thread(_encoded, snapshots, salts, labels, traffic, budget)
        return Response(body, media_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _take(
    source: SnapshotSource, budget: int, salts: frozenset[str]
) -> tuple[dict[str, Any], list[Any]]:
    """On a worker thread: the snapshots by name, and the sources of their labels
    (``label_sources``)."""
    snapshots = dict(sorted(source(budget).items()))
    return snapshots, label_sources(snapshots, salts)


def _decoded(tokenizer: Any, sources: list[Any]) -> list[str]:
    """On the tokenizing thread: one slice of the labels (their token lists made here, so
    they die young)."""
    return tokenizer.batch_decode(label_runs(sources))


def _encoded(
    snapshots: dict[str, Any], salts: frozenset[str], labels: list[str], traffic: list[Any],
    budget: int,
) -> bytes:
    """On a worker thread: the state as JSON bytes."""
    body = build_state(snapshots, salts, labels, traffic)
    body["budget"] = budget
    return msgspec.json.encode(body)


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
