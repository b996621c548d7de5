"""``radixkv serve``: the OpenAI-compatible server under uvicorn (and the other commands).

Shutdown on SIGTERM or SIGINT: uvicorn stops accepting connections and lets the requests in
flight finish for ``--grace-period`` seconds; what is still running then is aborted through
the engine (``server.shutdown``: streams end with finish_reason "abort" and [DONE], pages are
freed); the engine is closed and the process exits 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from engine import EngineConfig, build_parser, engine_options, run_command
from server.config import LOOPBACK_HOSTS, ServerConfig
from server.inspector.cli import add_inspect, run_inspect
from server.responses.store import StoreUnavailable, default_store_path

BUNDLED_NAME = "SmolLM2-135M-Instruct"


def add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        parents=[engine_options()],
        help="serve the OpenAI API (/v1/chat/completions, /v1/completions, ...) over HTTP",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("RADIXKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $RADIXKV_API_KEY)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name(s) in the API (default: the checkpoint's name)",
    )
    serve.add_argument(
        "--max-queued",
        type=int,
        default=None,
        metavar="N",
        help="answer 503 + Retry-After while N requests already wait (default: no limit)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help="answer 413 to request bodies over N bytes (default 4 MiB)",
    )
    serve.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM/SIGINT, let requests in flight finish for S seconds (default 30)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
    )
    serve.add_argument(
        "--response-store",
        default=None,
        metavar="PATH",
        help="SQLite file of /v1/responses' stored conversations (default: "
        "~/.cache/radixkv/responses.sqlite3; ':memory:' keeps them until exit)",
    )
    serve.add_argument(
        "--response-ttl",
        type=float,
        default=300.0,
        metavar="S",
        help="keep a stored response's tokens pinned in the KV pool for S seconds, so the "
        "conversation's next turn hits the cache (default 300; 0: no pin)",
    )
    serve.add_argument(
        "--inspect-public",
        action="store_true",
        help="answer the cache inspector (/inspect) beyond loopback too (default: loopback "
        "clients only; /inspect/state needs the API key either way)",
    )
    serve.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Host header names to answer besides loopback's (any port; '*': any). Bound to "
        "loopback (the default) the server answers only localhost, 127.0.0.1 and [::1] "
        "otherwise (421: a DNS-rebinding page names its own host); bound elsewhere, any "
        "name unless this lists them",
    )
    serve.add_argument(
        "--log-requests",
        default="on",
        choices=["on", "off"],
        help="one access line per request at info (method, path, status, time, tokens; "
        "never the prompt); default on",
    )


def model_name(model: str | None) -> str:
    """The API's default name for ``--model``: the checkpoint's file or directory name."""
    if model is None:
        return BUNDLED_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def is_loopback(host: str) -> bool:
    """Whether ``--host`` binds to loopback only (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """The Host names to answer: the listed ones, plus loopback's when bound to loopback;
    None (any) when bound elsewhere and none are listed."""
    listed = list(args.allowed_hosts or [])
    if is_loopback(args.host):
        return [*LOOPBACK_HOSTS, *listed]
    return listed or None


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ``ServerConfig`` of ``serve``'s flags (it checks itself: ValueError names the
    field)."""
    names = args.served_model_name or [model_name(args.model)]
    return ServerConfig(
        allowed_hosts=allowed_hosts(args),
        model_name=names[0],
        extra_model_names=names[1:],
        api_key=args.api_key,
        max_queued=args.max_queued,
        inspect_public=args.inspect_public,
        response_store=args.response_store,
        response_ttl=args.response_ttl,
        # access lines are info: below that level they would be made only to be dropped
        log_requests=args.log_requests == "on" and args.log_level in ("info", "debug"),
        **({} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}),
    )


def log_to_stderr(level: str) -> None:
    """radixkv's own loggers (the access lines, the server's and the engine's messages) to
    stderr at ``level``, beside uvicorn's lines: without a handler, Python drops what is
    below a warning."""
    logger = logging.getLogger("radixkv")
    logger.setLevel(level.upper())
    if not any(getattr(h, "radixkv", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s: %(message)s"))
        handler.radixkv = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def check_process_flags(args: argparse.Namespace) -> None:
    """What only the serving process reads (no config holds these)."""
    if args.port < 0:
        raise ValueError(f"--port: must be >= 0, got {args.port}")
    if args.grace_period < 0:
        raise ValueError(f"--grace-period: must be >= 0, got {args.grace_period}")


def store_error(args: argparse.Namespace, exc: StoreUnavailable) -> int:
    """A store that cannot be opened, as one line naming the flag (exit code 2)."""
    flag = args.response_store or str(default_store_path())
    where = "" if exc.path == flag else f"{exc.path} (beside it): "
    print(f"radixkv serve: --response-store {flag}: {where}{exc.reason}", file=sys.stderr)
    return 2


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine import Engine
    from server.app import create_app
    from server.shutdown import ENDING_S, DrainingServer
    from server.state import open_stores

    try:
        check_process_flags(args)
        engine_config = EngineConfig.from_args(args)
        config = server_config(args)
    except ValueError as exc:
        print(f"radixkv: error: {exc}", file=sys.stderr)
        return 2
    try:  # before minutes of loading a model: the stores' files open (then again, for use)
        for store in open_stores(config):
            store.close()
    except StoreUnavailable as exc:
        return store_error(args, exc)
    log_to_stderr(args.log_level)
    started = time.perf_counter()
    print("radixkv: loading model ...", file=sys.stderr, flush=True)
    try:
        engine = Engine(engine_config)
    except ValueError as exc:
        print(f"radixkv: error: {exc}", file=sys.stderr)
        return 2
    names = config.names
    try:
        app = create_app(engine, config)
    except StoreUnavailable as exc:  # changed since the check above
        engine.close()
        return store_error(args, exc)
    print(
        f"radixkv: {names[0]} on {engine.device} ({str(engine.dtype).removeprefix('torch.')}), "
        f"KV cache {engine.num_pages} pages x {engine.page_size} tokens, loaded in "
        f"{time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.grace_period + ENDING_S,
            access_log=False,  # ours (server.access_log) has the time and the tokens
        ),
        engine,
        args.grace_period,
    )
    # uvicorn re-raises the signal that stopped it once it is done, under the handlers that
    # were there before: ours, which let the process end normally (exit 0) after the drain.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.close()
    print("radixkv: stopped", file=sys.stderr, flush=True)
    return 0 if server.started else 1


def add_server_commands(commands: argparse._SubParsersAction) -> None:
    """``serve`` and ``inspect`` beside the engine's commands."""
    add_serve(commands)
    add_inspect(commands)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(add_server_commands).parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "inspect":
        return run_inspect(args)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
