"""``radixkv``: the engine's commands and ``serve``; ``serve --replicas N`` runs N engine
replicas on Ray Serve behind the cache-aware router (``cluster.serve``).

Ray is imported only when ``--replicas`` is given, so the other commands start as fast as
before. Without ``--ray-address`` a local Ray instance is started with exactly the CPUs the
replicas ask for (``--replicas`` x ``--threads``, plus one for Serve's proxy and the front
end); with ``--ray-address auto`` the application joins a running (multi-node) cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence

from cluster.config import ROUTERS, ClusterConfig
from engine import EngineConfig, build_parser, run_command
from server import cli as server_cli
from server.inspector import cli as inspector_cli


def add_serve(commands: argparse._SubParsersAction) -> None:
    server_cli.add_serve(commands)
    serve = commands.choices["serve"]
    group = serve.add_argument_group("replicas on Ray Serve")
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="run N engine replicas on Ray Serve behind a router (default: one engine, no Ray)",
    )
    group.add_argument(
        "--router",
        default="cache_aware",
        choices=ROUTERS,
        help="cache_aware (ours: page hashes from KV events), power_of_two (Ray Serve's "
        "default), prefix_affinity (Ray Serve LLM's PrefixCacheAffinityRouter)",
    )
    group.add_argument(
        "--balance-threshold",
        type=int,
        default=4,
        metavar="Q",
        help="cache_aware: leave the best-cached replica when its queue exceeds the least "
        "loaded one's by more than Q requests (default 4)",
    )
    group.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=64,
        metavar="N",
        help="requests Ray Serve sends one replica at once (default 64; Ray's 5 would starve "
        "continuous batching)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster ('auto': the one on this machine) instead of starting one",
    )


LOOPBACK = "127.0.0.1"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_ENV = "RAY_AUTH_MODE"


class StopRequested(Exception):
    """SIGINT or SIGTERM: unwind to the cleanup that stops Serve and Ray."""


def _stop_requested(signum: int, frame: object) -> None:
    raise StopRequested(signal.Signals(signum).name)


def _catch_stops() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_requested)


def serve_replicas(args: argparse.Namespace) -> int:
    """Start Ray (or join it), deploy the application, serve until SIGINT/SIGTERM."""
    try:
        server_cli.check_process_flags(args)  # what no config holds (the port, the grace)
        config = ClusterConfig(
            replicas=args.replicas,
            engine=EngineConfig.from_args(args, threads=1),
            server=server_cli.server_config(args),
            router=args.router,
            balance_threshold=args.balance_threshold,
            max_ongoing_requests=args.max_ongoing_requests,
        )
    except ValueError as exc:
        print(f"radixkv: error: {exc}", file=sys.stderr)
        return 2
    threads = config.threads
    names = config.server.names
    if args.ray_address is None:
        # A local cluster listens on loopback only: Ray has no authentication of its own
        # before 2.5x's tokens, and anyone who reaches its ports (GCS, raylet, workers,
        # agents) runs code as this user. Ray keeps a single-node cluster on 127.0.0.1 where
        # clusters are off (its macOS/Windows default, this switch); otherwise it swaps
        # 127.0.0.1 for the machine's address and binds its gRPC servers to every interface.
        # Read when Ray is imported, inherited by every process it starts.
        os.environ[LOCAL_ONLY_ENV] = "0"
        # Each Serve replica's inter-deployment gRPC server, bound to [::] in Ray Serve's
        # code, is rebound to the node's address by our replicas (cluster.serve.
        # bind_replica_grpc_to_node) and checked below; Ray's token authentication is asked
        # for as well, explicitly rather than left to Ray's default.
        os.environ.setdefault(AUTH_ENV, "token")
    import ray
    from ray import serve

    from cluster.serve import build_app, stop_hub

    started = time.perf_counter()
    serving = False
    # A stop may come at any moment, start-up included (Ray's processes are already running
    # by the time /health first answers): from here on it unwinds through the cleanup below.
    _catch_stops()
    try:
        if args.ray_address is None:
            ray.init(  # on loopback: see LOCAL_ONLY_ENV above
                num_cpus=args.replicas * threads + 1,
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
            )
        else:
            ray.init(address=args.ray_address)
        _catch_stops()  # in case Ray installed handlers of its own
        serve.start(http_options={"host": args.host, "port": args.port})
        serving = True  # from here requests may be in flight (/health answers before run returns)
        serve.run(build_app(config), name="radixkv", route_prefix="/", blocking=False)
        exposed = _exposed_listeners() if args.ray_address is None else []
        if exposed:
            print(
                "radixkv: error: the local Ray cluster listens beyond loopback ("
                + ", ".join(exposed)
                + "); refusing to serve: anyone who reaches these ports runs code as this user",
                file=sys.stderr,
                flush=True,
            )
            return 2
        print(
            f"radixkv: {names[0]}: {args.replicas} replicas x {threads} threads, router "
            f"{args.router}, on http://{args.host}:{args.port} (ready in "
            f"{time.perf_counter() - started:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(3600)
    except StopRequested:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut cleanup
            signal.signal(sig, signal.SIG_IGN)
        if ray.is_initialized():
            if serving:
                _drain(config.hub_name, args.grace_period)
            with contextlib.suppress(Exception):
                serve.shutdown()
            with contextlib.suppress(Exception):
                stop_hub(config.hub_name)
            ray.shutdown()
    print("radixkv: stopped", file=sys.stderr, flush=True)
    return 0


def _exposed_listeners() -> list[str]:
    """Every listening socket of this process and those it started (GCS, raylet, agents,
    workers, Serve's actors) that is not on loopback, as "name (pid) on address:port".
    Run once every replica is up (each starts its servers as it initialises), to refuse
    to serve where a Ray component binds beyond the address it was given."""
    import ipaddress

    import psutil  # Ray's own dependency (vendored with it)

    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return (mapped or address).is_loopback

    root = psutil.Process()
    found = []
    for process in (root, *root.children(recursive=True)):
        try:
            name = process.name()
            sockets = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for s in sockets:
            if s.status == psutil.CONN_LISTEN and not loopback(s.laddr.ip):
                found.append(f"{name} ({process.pid}) on {s.laddr.ip}:{s.laddr.port}")
    return found


def _drain(hub_name: str, grace_s: float) -> None:
    """As one engine's server stops: refuse new requests (503), let those in flight finish
    for ``grace_s``, then abort the rest in the replicas (their streams end with
    finish_reason "abort" and [DONE]) and give those last chunks ``ENDING_S`` to go out.
    Serve's own shutdown cut every request at once (no last chunk, no [DONE])."""
    from ray import serve

    from cluster.serve import close_replicas
    from server.shutdown import ENDING_S

    try:
        front = serve.get_deployment_handle("OpenAIFront", app_name="radixkv")
        if not front.drain.remote(grace_s).result(timeout_s=grace_s + 30):
            close_replicas(hub_name)
            front.drain.remote(ENDING_S).result(timeout_s=ENDING_S + 30)
        time.sleep(0.5)  # the last chunks leave the proxy
    except Exception as exc:  # draining must not keep the cluster up
        print(f"radixkv: draining failed ({exc!r}); stopping anyway", file=sys.stderr)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``serve`` (with ``--replicas``) and ``inspect`` beside the engine's commands."""
    add_serve(commands)
    inspector_cli.add_inspect(commands)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(add_commands).parse_args(argv)
    if args.command == "inspect":
        return inspector_cli.run_inspect(args)
    if args.command == "serve":
        if args.replicas is not None:
            return serve_replicas(args)
        return server_cli.serve(args)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
