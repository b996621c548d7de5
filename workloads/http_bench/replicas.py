"""``python -m workloads.replica_bench``: replicas behind each router, end to end.

For every repeat and router (interleaved: A B C A B C), starts ``radixkv serve --replicas N
--router R`` (a local Ray cluster, one core per replica, small KV pools so that a trace does
not fit in one replica), drives each workload through the serving benchmark
(``workloads.serve_bench``: Poisson arrivals, streamed requests), reads the requests each
replica served from the front end's ``/v1/replicas``, and stops the server. Prints one row
per workload and router: medians over the repeats.

    python -m workloads.replica_bench                       # 2 replicas, 3 routers, 2 repeats
    python -m workloads.replica_bench --routers cache_aware power_of_two --repeats 3
    python -m workloads.replica_bench --workloads rag20 returning --kv-remote off on \
        --routers cache_aware power_of_two --repeats 2      # the shared tier on vs off

``--kv-remote on`` starts a fresh Redis server (``workloads.redis_server``) for each server
run, every replica sharing it; ``prompt tokens computed`` is what the replicas prefilled.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from workloads import redis_server
from workloads.http_bench import bench as serve_bench

ROUTERS = ("cache_aware", "prefix_affinity", "power_of_two")
# Sized for a 2-core machine: each trace's distinct prefixes fill more than one replica's pool.
# Arrivals are serve_bench's (--request-rate), not the traces' own.
WORKLOADS: dict[str, list[str]] = {
    "tenants": ["tenants=12", "sessions=48", "turns=2"],
    "rag": ["documents=12", "doc_tokens=320", "requests=64"],
    # The shared tier's case: 20 documents (~400 pages) and 16 returning users (~24 pages of
    # context each) over pools of 192 pages: what a replica computed falls out of its pool.
    "rag20": ["documents=20", "doc_tokens=320", "requests=80"],
    "returning": ["users=16", "turns=3", "context_tokens=384"],
}
GENERATOR = {"rag20": "rag", "returning": "sessions"}  # the serve_bench workload of each


@dataclass
class ReplicaRun:
    workload: str
    router: str
    repeat: int
    kv_remote: bool
    hit_rate: float
    request_throughput: float
    output_throughput: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    failed: int
    per_replica: list[int]  # requests each replica served, busiest first
    computed_tokens: int = 0  # prompt tokens the replicas prefilled
    remote_tokens: int = 0  # prompt tokens loaded from the shared store

    @property
    def imbalance(self) -> float:
        mean = sum(self.per_replica) / len(self.per_replica)
        return self.per_replica[0] / mean if mean else 1.0


def free_port() -> int:
    """A free loopback port below the OS's ephemeral range and above Ray's worker ports
    (10002-19999): a port the OS handed out could be taken by one of Ray's many processes
    before the server binds it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 30000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class ReplicaServer:
    """``radixkv serve --replicas N`` (``module`` ``server.cli``: one engine, no Ray) as a
    subprocess on a free loopback port."""

    def __init__(
        self, args: list[str], ready_timeout: float = 300.0, module: str = "cluster.cli"
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="radixkv-replicas-", suffix=".log")
        command = [
            sys.executable,
            "-m",
            module,
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *args,
        ]
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not ready in {ready_timeout} s")

    def replicas(self) -> dict[str, dict[str, Any]]:
        return httpx.get(self.url + "/v1/replicas", timeout=10).json()

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def served(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[int]:
    counts = [grown(before, after, name, "requests") for name in after]
    return sorted(counts, reverse=True)


def grown(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], name: str,
          counter: str) -> int:
    """How much one replica's counter grew (a replica new since ``before`` from 0)."""
    def value(stats: dict[str, Any]) -> int:
        return int(stats.get("counters", {}).get(counter, 0))

    return value(after[name]) - value(before.get(name, {}))


def total(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
          counter: str) -> int:
    return sum(grown(before, after, name, counter) for name in after)


@contextmanager
def shared_store(on: bool) -> Iterator[list[str]]:
    """The server flags of the shared tier: a fresh Redis server's URL when ``on``."""
    if not on:
        yield []
        return
    with tempfile.TemporaryDirectory(prefix="radixkv-bench-redis-") as folder:
        with redis_server.redis_server(Path(folder)) as (url, _):
            yield ["--kv-remote", url]


def run_once(
    server: ReplicaServer, workload: str, router: str, repeat: int, seed: int, rate: str = "inf",
    kv_remote: bool = False,
) -> ReplicaRun:
    before = server.replicas()
    generator = GENERATOR.get(workload, workload)
    argv = ["--url", server.url, "--workload", generator, "--seed", str(seed), "--quiet"]
    argv += ["--request-rate", rate]
    for item in WORKLOADS[workload]:
        argv += ["--set", item]
    report = serve_bench.main(argv)
    time.sleep(1.5)  # the replicas publish their stats every 0.5 s
    summary = report.rates[0].median
    after = server.replicas()
    return ReplicaRun(
        workload,
        router,
        repeat,
        kv_remote,
        summary.hit_rate or 0.0,
        summary.request_throughput,
        summary.output_throughput,
        summary.ttft.p50,
        summary.ttft.p90,
        summary.ttft.p99,
        summary.failed,
        served(before, after),
        total(before, after, "prompt_tokens") - total(before, after, "cached_tokens"),
        total(before, after, "cached_tokens_remote"),
    )


def format_table(runs: Sequence[ReplicaRun]) -> str:
    groups: dict[tuple[str, str, bool], list[ReplicaRun]] = defaultdict(list)
    for run in runs:
        groups[(run.workload, run.router, run.kv_remote)].append(run)
    header = (
        "| workload | router | shared tier | runs | hit rate | of it remote | prompt tokens "
        "computed | req/s | output tok/s | TTFT p50 s | TTFT p90 s | TTFT p99 s | "
        "requests per replica | imbalance |"
    )
    lines = [header, "|" + "---|" * 14]
    for (workload, router, remote), items in sorted(groups.items()):

        def med(attr: str, items: list[ReplicaRun] = items) -> float:
            return statistics.median(getattr(r, attr) for r in items)

        per = [
            statistics.median(r.per_replica[i] for r in items)
            for i in range(len(items[0].per_replica))
        ]
        prompt = [r.computed_tokens / (1 - r.hit_rate) if r.hit_rate < 1 else 0 for r in items]
        remote_share = statistics.median(
            r.remote_tokens / p if p else 0.0 for r, p in zip(items, prompt)
        )
        lines.append(
            f"| {workload} | {router} | {'on' if remote else 'off'} | {len(items)} | "
            f"{med('hit_rate'):.1%} | {remote_share:.1%} | {med('computed_tokens'):,.0f} | "
            f"{med('request_throughput'):.2f} | {med('output_throughput'):.1f} | "
            f"{med('ttft_p50'):.2f} | {med('ttft_p90'):.2f} | {med('ttft_p99'):.2f} | "
            f"{' / '.join(f'{n:g}' for n in per)} | {med('imbalance'):.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[ReplicaRun]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-pages", type=int, default=192, help="KV pages per replica")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--request-rate", default="inf",
        help="sessions per second, Poisson (serve_bench's; inf: all at once, an overload)",
    )
    parser.add_argument(
        "--kv-remote", nargs="+", default=["off"], choices=("off", "on"),
        help="the shared tier (a fresh Redis server per run) off, on, or both, interleaved",
    )
    parser.add_argument("--json", default=None, help="also write every run here")
    args = parser.parse_args(argv)
    runs: list[ReplicaRun] = []
    for repeat in range(args.repeats):
        for router in args.routers:
            for remote in (setting == "on" for setting in args.kv_remote):
                with shared_store(remote) as remote_flags:
                    server = ReplicaServer([
                        "--replicas", str(args.replicas), "--threads", "1", "--router", router,
                        "--num-pages", str(args.num_pages), *remote_flags,
                    ])
                    try:
                        for workload in args.workloads:
                            run = run_once(server, workload, router, repeat, args.seed,
                                           args.request_rate, remote)
                            runs.append(run)
                            print(format_table([run]).splitlines()[-1], flush=True)
                    finally:
                        server.stop()
    print()
    print(format_table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in runs], f, indent=1)
    return runs


if __name__ == "__main__":
    main()
