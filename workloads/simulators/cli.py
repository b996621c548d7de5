"""Cache-only simulator: synthetic traces through the real Scheduler, no model.

The "model" samples a scripted token (a function of the session, the turn and the position),
so every reply, and therefore every closed-loop prompt, is known in advance and identical
across policies and capacities. What a step costs is counted, not timed: prefill tokens
computed, decode tokens, steps. The ideal hit rate is that of an infinite cache with perfect
grouping: a prompt page hits if any earlier request (in submission order) computed it.

    python -m workloads.simulate                      # every trace, policy, capacity
    python -m workloads.simulate --traces rag --policies lpm fcfs --capacities 1 0.1
    python -m workloads.simulate --replicas 2 8 64 --router all   # a cluster: simulate_cluster
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from scheduler import POLICIES
from workloads.simulators.cluster import (
    BALANCE_THRESHOLD,
    PENDING_TTL_STEPS,
    ROUTERS,
    SIM_ROUTERS,
    format_turns_table,
    simulate_cluster,
)
from workloads.simulators.cluster import format_table as format_cluster_table
from workloads.simulators.one_engine import format_table, simulate
from workloads.simulators.stats import pool_pages, trace_stats
from workloads.traces.synthetic import CLUSTER_TRACES, TRACES

CLUSTER_DESCRIPTION = (
    "Cache-only cluster simulator: N replicas (real Schedulers), one router, no model."
)


def main(argv: list[str] | None = None) -> None:
    """One engine per trace, policy and capacity; with ``--replicas``, clusters instead."""
    argv = sys.argv[1:] if argv is None else argv
    if "--replicas" in argv:  # many replicas behind a router: workloads.simulators.cluster
        cluster_main(argv)
        return
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="A cluster of replicas behind a router: --replicas N [N ...] [--router NAME ...] "
        "(workloads.simulators.cluster; 'python -m workloads.simulate --replicas 2 --help' lists "
        "its options).",
    )
    parser.add_argument(
        "--replicas", nargs="+", type=int, metavar="N",
        help="simulate N replicas behind a router instead (see below)",
    )
    parser.add_argument("--traces", nargs="*", default=list(TRACES), choices=list(TRACES))
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument(
        "--capacities", nargs="*", type=float, default=[1.0, 0.25, 0.1],
        help="pool size as fractions of each trace's working set (pages)",
    )
    parser.add_argument(
        "--remote-capacity", type=float, nargs="+", default=[0.0],
        help="KV tiers: one remote store every replica shares, as a fraction of the working "
        "set (0: none); several values run each",
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-running", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    config: dict[str, object] = {}
    if args.max_batch_tokens is not None:
        config["max_batch_tokens"] = args.max_batch_tokens
    if args.max_running is not None:
        config["max_running"] = args.max_running
    results = []
    for name in args.traces:
        trace = TRACES[name]()
        stats = trace_stats(trace, args.page_size)
        for fraction in args.capacities:
            for policy in args.policies:
                result = simulate(
                    trace, policy, pool_pages(stats, fraction), args.page_size, stats, **config
                )
                results.append(result)
                print(format_table([result]).splitlines()[-1], flush=True)
    report(results, format_table, args.json)


def cluster_main(argv: list[str] | None = None) -> None:
    """Every trace x replica count x router: ``--replicas N [N ...] --router NAME|all``."""
    traces = {**CLUSTER_TRACES, **TRACES}
    parser = argparse.ArgumentParser(description=CLUSTER_DESCRIPTION)
    parser.add_argument("--replicas", nargs="+", type=int, required=True)
    parser.add_argument(
        "--router", nargs="+", default=["all"], choices=[*SIM_ROUTERS, "all"],
        help="'all' is every router of a deployment (not cache_aware_pool_only, the tier-blind "
        "cache_aware kept to measure against)",
    )
    parser.add_argument("--traces", nargs="+", default=list(CLUSTER_TRACES), choices=list(traces))
    parser.add_argument(
        "--capacity",
        type=float,
        default=1.0,
        help="fraction of the trace's working set the whole cluster holds, split evenly",
    )
    parser.add_argument(
        "--host-capacity", type=float, default=0.0,
        help="KV tiers: host memory under each pool, as a fraction of the working set the "
        "whole cluster holds there (0: none); their later turns are tabled apart",
    )
    parser.add_argument(
        "--disk-capacity", type=float, default=0.0,
        help="KV tiers: disk under each pool (files on tmpfs), likewise",
    )
    parser.add_argument(
        "--remote-capacity", type=float, nargs="+", default=[0.0],
        help="KV tiers: one remote store every replica shares, as a fraction of the working "
        "set (0: none); several values run each",
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--balance-threshold", type=int, default=BALANCE_THRESHOLD)
    parser.add_argument(
        "--pending-ttl",
        type=float,
        default=PENDING_TTL_STEPS,
        help="cache_aware: steps a routed chain counts as held (pending)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    routers = list(ROUTERS) if "all" in args.router else args.router
    results = []
    for trace_name in args.traces:
        trace = traces[trace_name]()
        stats = trace_stats(trace, args.page_size)
        for n in args.replicas:
            pages = pool_pages(stats, args.capacity, n)
            host = int(stats.working_set_pages * args.host_capacity / n)
            disk = int(stats.working_set_pages * args.disk_capacity / n)
            for remote_capacity, router in itertools.product(args.remote_capacity, routers):
                result = simulate_cluster(
                    trace,
                    router,
                    n,
                    pages,
                    args.page_size,
                    stats,
                    balance_threshold=args.balance_threshold,
                    pending_ttl=args.pending_ttl,
                    host_pages=host,
                    disk_pages=disk,
                    remote_pages=int(stats.working_set_pages * remote_capacity),
                )
                results.append(result)
                print(format_cluster_table([result]).splitlines()[-1], flush=True)
    report(results, format_cluster_table, args.json)
    if any(r.later_requests for r in results):
        print()
        print(format_turns_table(results))


def report(results: Sequence[Any], table: Callable[[Sequence[Any]], str],
           json_path: str | None) -> None:
    """Print every result as one table; also write them to ``json_path`` when given."""
    print()
    print(table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
