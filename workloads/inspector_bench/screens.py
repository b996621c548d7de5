"""Screenshots of the inspector under a workload: ``python -m workloads.inspector_bench.screens
--workload rag --replicas 2 --out docs/bench/inspect-rag-2.png``.

Starts ``radixkv serve`` (one engine, or ``--replicas N`` behind the cache-aware router),
opens ``/inspect`` in headless Chromium, runs ``workloads.serve_bench`` against the server
(``--isolate none``: the prompts as the workload writes them, so the tree's labels are
text), and keeps the last screenshot taken while the workload was still running. Fails on
any console error of the page. The PNG is quantised to a palette to stay small.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from workloads.http_bench.replicas import free_port
from workloads.inspector_bench.chromium import HeadlessChromium

SIZES = {  # small enough for a 2-core machine, big enough to fill a 256-page pool
    "rag": ["documents=10", "requests=40", "doc_tokens=384", "question_tokens=32",
            "max_new_tokens=16"],
    "chat": ["users=8", "turns=5", "system_tokens=256", "user_tokens=32",
             "max_new_tokens=32"],
}


def start_server(port: int, replicas: int, num_pages: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port),
               "--dtype", "float32", "--num-pages", str(num_pages), "--log-level", "warning",
               "--log-requests", "off"]
    if replicas:
        command += ["--replicas", str(replicas), "--threads", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, process: subprocess.Popen, replicas: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                if not replicas or len(httpx.get(url + "/v1/replicas", timeout=5).json()) >= replicas:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready in {timeout_s} s")


def shrink(path: Path) -> None:
    """A palette PNG: the page has few colours, so this keeps it small."""
    from PIL import Image

    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=64).save(path, optimize=True)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m workloads.inspector_bench.screens")
    parser.add_argument("--workload", choices=sorted(SIZES), default="rag")
    parser.add_argument("--replicas", type=int, default=0, help="0: one engine, no Ray")
    parser.add_argument("--num-pages", type=int, default=256)
    parser.add_argument("--request-rate", default="1", help="sessions per second")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every-s", type=float, default=3.0, help="screenshot interval")
    args = parser.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="radixkv-screens-", suffix=".log")[1])
    server = start_server(port, args.replicas, args.num_pages, log)
    try:
        wait_ready(url, server, args.replicas, 600)
        with HeadlessChromium() as browser:
            browser.open(url + "/inspect", width=1400, height=1000)
            browser.wait_for("Number(document.body.dataset.rendered || 0) >= 1", 60)
            bench = subprocess.Popen(
                [sys.executable, "-m", "workloads.serve_bench", "--url", url, "--workload",
                 args.workload, "--isolate", "none", "--request-rate", args.request_rate,
                 "--quiet", *[f"--set={item}" for item in SIZES[args.workload]]],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )
            shots = 0
            while bench.poll() is None:
                browser.pump(args.every_s)
                if bench.poll() is not None:
                    break
                replicas_shown = browser.evaluate(
                    "window.radixkvState ? window.radixkvState.replicas.length : 0")
                if replicas_shown >= max(args.replicas, 1):
                    browser.screenshot(args.out)
                    shots += 1
            if bench.returncode != 0:
                raise RuntimeError(f"serve_bench failed ({bench.returncode})")
            if not shots:
                raise RuntimeError("the workload ended before a screenshot was taken")
            browser.pump(0.5)
            if browser.errors:
                raise RuntimeError(f"the page reported errors: {browser.errors}")
    finally:
        server.terminate()
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
    shrink(args.out)
    print(f"{args.out}: {args.out.stat().st_size} bytes, {shots} screenshots taken")
    return args.out


if __name__ == "__main__":
    main()
