"""Replicas on Ray Serve: an OpenAI front end, N engine replicas, and the router between.

    HTTP -> Ray Serve proxy -> OpenAIFront (tokenizes, validates, the OpenAI app)
         -> handle.generate(EngineCall) -> request router -> EngineReplica (an Engine)

Each ``EngineReplica`` owns an Engine and publishes its KV events (page-hash batches, see
``cluster.events``) to the ``EventHub`` actor; the ``CacheAwareRequestRouter`` (our
``CacheAware`` policy behind Ray Serve's ``RequestRouter`` interface) pulls them in the
background and routes each call on the hashes of its token ids. Everything here is plain
Ray Serve: on a multi-node cluster the same application runs unchanged (``ray start`` on
every node, ``radixkv serve --replicas N --ray-address auto`` on one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cluster import disk_slots
from cluster.config import ClusterConfig
from cluster.events import KVEventBatch, KVEventPublisher
from cluster.hub import EventHub
from cluster.index import KVIndex
from cluster.inspector_board import InspectorBoard
from cluster.policy import CacheAware, RouteRequest
from cluster.remote import EngineCall, RemoteEngine
from cluster.replica_stats import ReplicaStats
from engine import EngineConfig
from engine.api import abort_on_exit

log = logging.getLogger("radixkv.cluster")

HUB_NAMESPACE = "radixkv"
INSPECT_EVERY_S = 1.0  # a replica's inspector snapshot, while someone watches
_RAY_ROUTERS = {
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "prefix_affinity": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
        "PrefixCacheAffinityRouter"
    ),
}


# ------------------------------------------------------------------------------ the hub


def start_hub(name: str) -> Any:
    """The named hub actor, created if missing. Detached: it must outlive the driver's
    handle (the replicas and routers find it by name); ``stop_hub`` ends it."""
    actor = ray.remote(num_cpus=0)(EventHub)
    # Restarted whenever its process dies (``stop_hub``'s kill is final): a new hub knows
    # nothing, so each replica's next publish is refused and it sends a snapshot.
    return actor.options(
        name=name, namespace=HUB_NAMESPACE, get_if_exists=True, lifetime="detached",
        max_restarts=-1,
    ).remote()


def stop_hub(name: str) -> None:
    for actor in (_hub, _board):  # the inspector's board lives and ends with the hub
        try:
            ray.kill(actor(name))
        except ValueError:  # never started, or gone already
            pass


def start_board(hub_name: str) -> Any:
    """The inspector's board (``InspectorBoard``), named after the hub, created if missing."""
    actor = ray.remote(num_cpus=0)(InspectorBoard)
    return actor.options(
        name=_board_name(hub_name), namespace=HUB_NAMESPACE, get_if_exists=True,
        lifetime="detached", max_restarts=-1,
    ).remote()


def _board(hub_name: str) -> Any:
    return ray.get_actor(_board_name(hub_name), namespace=HUB_NAMESPACE)


def _board_name(hub_name: str) -> str:
    return f"{hub_name}-inspect"


def close_replicas(name: str) -> None:
    """Every replica closes its engine within 0.5 s (shutting down: aborts what runs)."""
    _hub(name).close_replicas.remote()


def _hub(name: str) -> Any:
    return ray.get_actor(name, namespace=HUB_NAMESPACE)


# ------------------------------------------------------------------- where replicas listen

_WILDCARDS = ("[::]:", "0.0.0.0:")


def bind_replica_grpc_to_node() -> None:
    """Make this replica's inter-deployment gRPC server listen on this node's address only.

    Ray Serve binds that server (every replica has one) to ``[::]:0`` in its own code
    (``ray/serve/_private/replica.py``, ``_on_initialized``); no option or variable changes
    it, so each replica listened on every interface, and Ray's handles reach it at the
    node's address anyway. Called first in each replica's constructor, which Serve runs
    before it starts that server, in the same process. Where this Ray has no such hook, the
    replica refuses to start (a RuntimeError that says why) rather than listen everywhere.
    """
    from ray.serve._private import replica as serve_replica

    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None or not callable(original):
        raise RuntimeError(
            f"Ray {ray.__version__}: cannot bind Ray Serve's replica gRPC server to this "
            "node's address (ray.serve._private.replica.add_port_to_grpc_server is gone); "
            "refusing to listen on every interface"
        )
    if getattr(original, "radixkv_node", None) is not None:
        return  # already bound (a second replica class in the same process)
    node = ray.util.get_node_ip_address()
    host = f"[{node}]" if ":" in node else node

    def add_port(server: Any, address: str) -> int:
        if address.startswith(_WILDCARDS):
            address = f"{host}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    add_port.radixkv_node = node  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port


# ----------------------------------------------------------------------------- replicas


@serve.deployment
class EngineReplica:
    """One Engine; streams each ``EngineCall``'s events back and publishes its KV events."""

    def __init__(self, config: EngineConfig, hub_name: str, replicas: int = 1) -> None:
        bind_replica_grpc_to_node()
        import torch

        from engine import Engine

        self._disk_slot = None
        if config.kv_disk_dir is not None:  # a store of its own under the cluster's folder
            root = Path(config.kv_disk_dir).expanduser()
            budget = disk_slots.share(root, replicas, config.kv_disk_bytes)
            self._disk_slot = disk_slots.claim(root, replicas)
            config = config.replace(
                kv_disk_dir=str(self._disk_slot.folder), kv_disk_bytes=budget
            )

        # Ray sets OMP threads from the CPU share; be explicit
        torch.set_num_threads(config.threads or 1)
        self.engine = Engine(config)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.publisher = KVEventPublisher(self.name)
        self.engine.subscribe_kv(self.publisher.on_event)
        self._hub_name = hub_name
        self.hub = _hub(hub_name)
        ray.get(self.hub.publish_snapshot.remote(self.publisher.snapshot()))
        self.board = _board(hub_name)
        self._stop = threading.Event()
        self._publisher = threading.Thread(
            target=self._publish_forever, name="radixkv-kv-events", daemon=True
        )
        self._publisher.start()

    async def generate(self, call: EngineCall) -> AsyncIterator[Any]:
        """The engine's events for ``call``: ``Delta``s (when streaming), then the output.
        A cancelled stream (the client left) aborts the request. An ``unpin`` call ends the
        pins on its tokens' path and yields nothing."""
        if call.unpin:
            self.engine.unpin_prefix(call.token_ids, call.namespace)
            return
        handle = self.engine.submit(
            call.token_ids, call.params, call.namespace, call.stream, pin_ttl=call.pin_ttl
        )
        with abort_on_exit([handle]):
            async for item in handle.events():
                yield item

    def _publish_forever(self, interval_s: float = 0.02, stats_every_s: float = 0.5) -> None:
        last_stats = 0.0
        last_snapshot = 0.0
        resync = False
        while not self._stop.wait(interval_s):
            try:
                if time.monotonic() - last_snapshot >= INSPECT_EVERY_S:
                    last_snapshot = time.monotonic()
                    self._post_snapshot()
                stats = self.engine.stats()
                load = stats.requests_running + self.engine.num_waiting()
                batch = self.publisher.drain(load)
                if batch is not None and not ray.get(self.hub.publish.remote(batch)):
                    resync = True
                if resync:  # the hub lost track (or a publish failed): start it over
                    ray.get(self.hub.publish_snapshot.remote(self.publisher.snapshot()))
                    resync = False
                now = time.monotonic()
                if now - last_stats >= stats_every_s:
                    last_stats = now
                    if ray.get(self.hub.publish_stats.remote(self.name, stats)):
                        self.engine.close()  # shutting down: aborts what still runs
                    if batch is None:  # keep the router's view of our load fresh
                        self.hub.publish.remote(
                            KVEventBatch(self.name, self.publisher.epoch, 0, [], [], load)
                        )
            except Exception:  # the hub restarting must not take the replica down
                log.exception("publishing KV events failed; resyncing")
                resync = True
                time.sleep(1.0)
                with contextlib.suppress(Exception):  # a restarted hub is a new actor
                    self.hub = _hub(self._hub_name)

    def _post_snapshot(self) -> None:
        """While someone watches the inspector: this engine's snapshot to the board (a
        failure is logged and left to the next second: the KV events must go on)."""
        try:
            budget = ray.get(self.board.wanted.remote(), timeout=5)
            if budget is not None:
                self.board.post.remote(self.name, self.engine.inspect(budget, timeout=5))
        except Exception:
            log.exception("posting the inspector's snapshot failed")
            with contextlib.suppress(Exception):  # a restarted board is a new actor
                self.board = _board(self._hub_name)

    def __del__(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
            self.hub.forget.remote(self.name)
            self.board.forget.remote(self.name)
        if hasattr(self, "engine"):
            self.engine.close()  # the pool's pages go down to this replica's disk slot
        if getattr(self, "_disk_slot", None) is not None:
            self._disk_slot.release()


# ---------------------------------------------------------------------------- front end


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress()
class OpenAIFront:
    """The OpenAI app over a ``RemoteEngine``: requests go out as token ids."""

    def __init__(self, replicas: Any, config: ClusterConfig) -> None:
        bind_replica_grpc_to_node()
        from engine import load_front

        self._replicas = replicas
        self._hub = _hub(config.hub_name)
        self._board = _board(config.hub_name)
        self._page_size = config.engine.page_size
        self._stats = ReplicaStats()
        self.engine = RemoteEngine(
            load_front(config.engine.model), self._call, self._pool_tokens, self._summed_stats,
            priority_scheduling=config.engine.scheduler.scheduling_policy == "priority",
        )
        self._server = config.server
        if config.server.log_requests:  # the access lines reach the driver's stderr
            from server.cli import log_to_stderr

            log_to_stderr("info")
        threading.Thread(target=self._watch_stats, name="radixkv-stats", daemon=True).start()

    def _call(self, call: EngineCall) -> Any:
        return self._replicas.options(stream=True).generate.remote(call)

    async def drain(self, grace_s: float) -> bool:
        """Shutting down: new requests get a 503 (and /health), those in flight have up to
        ``grace_s`` to finish; True once none is left."""
        self._state.draining = True
        deadline = time.monotonic() + grace_s
        while self.engine.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.engine.num_in_flight()

    def _watch_stats(self) -> None:
        while True:
            try:
                self._stats.update(ray.get(self._hub.stats.remote()))
            except Exception:
                log.exception("reading the replicas' stats failed")
            time.sleep(0.5)

    def _pool_tokens(self) -> int | None:
        """The smallest replica's KV pool in tokens (None until one has reported)."""
        pools = [s.pages.total * self._page_size for s in self._stats.live.values()]
        return min(pools) if pools else None

    def _summed_stats(self) -> Any:
        return self._stats.total()

    def _replica_snapshots(self, budget: int) -> dict[str, Any]:
        """The replicas' latest inspector snapshots (they post them while someone reads)."""
        return ray.get(self._board.read.remote(budget), timeout=10)

    def __serve_build_asgi_app__(self) -> Any:
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        from server import create_app

        app = create_app(self.engine, self._server, snapshots=self._replica_snapshots)
        self._state = app.state.server

        async def replicas(request: Request) -> JSONResponse:
            """Per-replica engine stats (requests, hit rate, load): what the bench reads."""
            return JSONResponse(
                {name: s.to_dict() for name, s in sorted(self._stats.live.items())}
            )

        app.router.routes.insert(0, Route("/v1/replicas", replicas, methods=["GET"]))
        return app


# ------------------------------------------------------------------------------ router


class CacheAwareRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router running ``CacheAware`` on the replicas' KV events."""

    def initialize_state(
        self,
        hub_name: str = "radixkv-kv-hub",
        page_size: int = 16,
        balance_threshold: int = 4,
        pending_ttl_s: float = 2.0,
        poll_interval_s: float = 0.02,
    ) -> None:
        self._hub_name = hub_name
        self._index = KVIndex()
        self._policy = CacheAware(self._index, page_size, balance_threshold, pending_ttl_s)
        self._poll_interval_s = poll_interval_s
        self._cursors: dict[str, tuple[int, int]] = {}
        self._hub_loads: dict[str, int] = {}
        self._poller: asyncio.Task[None] | None = None
        # Requests sent to each replica and not completed: what a burst has already put on
        # a replica before any of it arrived there (a probe sees only what arrived).
        self._sent: dict[str, int] = {}

    def on_send_request(self, replica_id: Any) -> None:
        super().on_send_request(replica_id)
        name = replica_id.unique_id
        self._sent[name] = self._sent.get(name, 0) + 1

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        name = replica_id.unique_id  # Ray calls this once per request sent (a failed send
        self._sent[name] = max(0, self._sent.get(name, 0) - 1)  # too: never below 0)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._follow_hub())
        call = _call_of(pending_request)
        if call is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        loads = await self._loads(candidate_replicas)
        chosen = self._policy.choose(RouteRequest(call.token_ids, call.namespace), loads)
        first = next(r for r in candidate_replicas if r.replica_id.unique_id == chosen)
        return [[first], [r for r in candidate_replicas if r is not first]]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Each replica's ongoing requests: probed (as Ray's own routers do), else the last
        load it published; at least those this router sent it that have not completed (in
        a burst, most have not arrived yet: 8 at once on a new prefix had gone 7:1 past a
        balance threshold of 4)."""
        loads = {
            r.replica_id.unique_id: self._hub_loads.get(r.replica_id.unique_id, 0) for r in replicas
        }
        for replica, queue_len in await self._probe_queue_lens(replicas, 0):
            if queue_len is not None:
                loads[replica.replica_id.unique_id] = queue_len
        return {name: max(load, self._sent.get(name, 0)) for name, load in loads.items()}

    async def _follow_hub(self) -> None:
        """Pull the hub's batches forever: apply them in order, resync on a gap."""
        hub = None
        while True:
            try:
                if hub is None:
                    hub = _hub(self._hub_name)
                pulled = await hub.pull.remote(self._cursors)
                for update in pulled.updates:
                    if isinstance(update, KVEventBatch):
                        if self._index.apply(update):
                            self._cursors[update.replica] = (update.epoch, update.seq)
                        else:
                            self._cursors.pop(update.replica, None)  # a snapshot next time
                    else:
                        self._index.resync(update)
                        self._cursors[update.replica] = (update.epoch, update.seq)
                for gone in set(self._index.replicas()) - set(pulled.loads):
                    self._index.remove_replica(gone)
                    self._cursors.pop(gone, None)
                self._hub_loads = pulled.loads
                await asyncio.sleep(self._poll_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("following the KV event hub failed; retrying")
                hub = None
                await asyncio.sleep(1.0)


def _call_of(pending_request: PendingRequest | None) -> EngineCall | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, EngineCall):
            return arg
    return None


# ------------------------------------------------------------------------- application


def router_config(config: ClusterConfig) -> RequestRouterConfig:
    if config.router == "cache_aware":
        return RequestRouterConfig(
            request_router_class=CacheAwareRequestRouter,
            request_router_kwargs={
                "hub_name": config.hub_name,
                "page_size": config.engine.page_size,
                "balance_threshold": config.balance_threshold,
            },
        )
    return RequestRouterConfig(request_router_class=_RAY_ROUTERS[config.router])


def build_app(config: ClusterConfig) -> Any:
    """The Serve application: the front end bound to ``config.replicas`` engine replicas.
    Call after ``ray.init`` (the hub actor is started here)."""
    start_hub(config.hub_name)
    start_board(config.hub_name)
    replicas = EngineReplica.options(
        num_replicas=config.replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.threads},
        request_router_config=router_config(config),
    ).bind(config.engine, config.hub_name, config.replicas)
    return OpenAIFront.bind(replicas, config)
