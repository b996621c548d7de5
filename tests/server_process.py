"""A real ``radixkv serve`` process for tests (started by fixtures, stopped with SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from workloads.http_bench.replicas import free_port


class ServerProcess:
    """A real ``radixkv serve`` subprocess on a free loopback port (the bundled model)."""

    def __init__(
        self,
        *args: str,
        ready_timeout: float = 180.0,
        module: str = "server.cli",
        log_level: str | None = "warning",
    ) -> None:
        """``log_level`` None: the server's default (info, with its access lines)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="radixkv-serve-", suffix=".log")
        command = [
            sys.executable,
            "-m",
            module,
            "serve",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            *(["--log-level", log_level] if log_level else []),
            *args,
        ]
        if "--response-store" not in args:  # not the user's ~/.cache: one store per process
            self._store = tempfile.TemporaryDirectory(prefix="radixkv-responses-")
            command += ["--response-store", os.path.join(self._store.name, "responses.sqlite3")]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"radixkv serve exited early:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"radixkv serve not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, timeout: float = 60.0) -> int:

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except Exception:
            self.process.kill()
            return self.process.wait()
