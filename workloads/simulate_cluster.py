"""Cache-only cluster simulator: N replicas (real Schedulers), one router, no model.

Each replica is a ``Scheduler`` over its own ``KVManager`` with a ``KVEventPublisher``
attached; the router keeps a ``KVIndex`` fed at the start of every step from every replica's
publisher, so the events of step k reach it at step k+1, as they would in a deployment.
Each step: the requests arriving now are routed (first turns at their session's arrival,
later turns the step after the previous turn finished), with each replica's load = its
waiting + running requests; then every replica runs one step with the scripted replies of
``workloads.simulate``. The ideal hit rate is one infinite cache (``trace_stats``).

    python -m workloads.simulate --replicas 2 8 64 --router all --traces tenants rag_corpus
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster import (
    POLICY_NAMES,
    CacheAware,
    KVEventPublisher,
    KVIndex,
    LeastLoaded,
    RoundRobin,
    RouteRequest,
    RoutingPolicy,
    TextPrefixAffinity,
)
from radix import KVManager
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from workloads.simulate import TraceStats, reply_token, report, trace_stats
from workloads.synthetic import CLUSTER_TRACES, TRACES, SimTrace

ROUTERS = ("cache_aware", "text_prefix", "round_robin", "least_loaded")
assert set(ROUTERS) == set(POLICY_NAMES)

BALANCE_THRESHOLD = 4  # requests; the same for cache_aware and text_prefix
PENDING_TTL_STEPS = 32
BALANCE_WINDOW_STEPS = 1000  # half-life of cache_aware's recent-request counts, in steps


@dataclass
class ClusterResult:
    trace: str
    router: str
    replicas: int
    pages_per_replica: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ideal_hit_rate: float
    hit_ratio: float  # hit_rate / ideal_hit_rate
    requests_per_replica: list[int]
    imbalance: float  # busiest replica's requests / mean
    steps: int  # makespan
    evicted_pages: int
    index_max_hashes: int
    balanced: int  # cache_aware: requests sent away from their best match for load
    wall_s: float


def make_router(
    name: str,
    index: KVIndex,
    page_size: int,
    clock: Callable[[], float],
    balance_threshold: int = BALANCE_THRESHOLD,
    pending_ttl: float = PENDING_TTL_STEPS,
    seed: int = 0,
    balance_window: float = BALANCE_WINDOW_STEPS,
) -> RoutingPolicy:
    if name == "cache_aware":
        return CacheAware(
            index,
            page_size,
            balance_threshold,
            pending_ttl,
            seed,
            clock,
            window_s=balance_window,
        )
    if name == "text_prefix":
        return TextPrefixAffinity(imbalance_threshold=balance_threshold, seed=seed)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(seed)
    raise ValueError(f"router: expected one of {ROUTERS}, got {name!r}")


def simulate_cluster(
    trace: SimTrace,
    router_name: str,
    replicas: int,
    pages_per_replica: int,
    page_size: int = 16,
    stats: TraceStats | None = None,
    balance_threshold: int = BALANCE_THRESHOLD,
    pending_ttl: float = PENDING_TTL_STEPS,
    seed: int = 0,
    keep: list[object] | None = None,
    balance_window: float = BALANCE_WINDOW_STEPS,
    **config: object,
) -> ClusterResult:
    """Run ``trace`` to completion on ``replicas`` replicas of ``pages_per_replica`` pages.

    ``keep``, when given, receives the router, the index and the (name, scheduler,
    publisher) triples, for tests to inspect the end state."""
    stats = stats if stats is not None else trace_stats(trace, page_size)
    started = time.perf_counter()
    sched_config = SchedulerConfig(page_size=page_size, **config)  # type: ignore[arg-type]
    names = [f"r{i:02d}" for i in range(replicas)]
    scheds: dict[str, Scheduler] = {}
    publishers: dict[str, KVEventPublisher] = {}
    index = KVIndex()
    for i, name in enumerate(names):
        kv = KVManager(pages_per_replica, page_size, sched_config.prefix_cache)
        publishers[name] = publisher = KVEventPublisher(name, epoch=i)
        publisher.attach(kv)
        scheds[name] = Scheduler(kv, sched_config)
        index.resync(publisher.snapshot())
    step = 0
    router = make_router(
        router_name,
        index,
        page_size,
        lambda: step,
        balance_threshold,
        pending_ttl,
        seed,
        balance_window,
    )

    sessions = trace.sessions
    arrivals = [(session.arrival, s) for s, session in enumerate(sessions)]
    heapq.heapify(arrivals)
    follow: list[tuple[int, int, list[int]]] = []  # turns to route next step
    turn_of: dict[int, tuple[int, int]] = {}  # request id -> (session, turn)
    routed = dict.fromkeys(names, 0)
    index_max = 0

    def drain() -> None:
        for name, publisher in publishers.items():
            sched = scheds[name]
            batch = publisher.drain(sched.num_waiting + sched.num_running)
            if batch is not None and not index.apply(batch):
                index.resync(publisher.snapshot())

    def route(s: int, t: int, history: list[int], loads: dict[str, int]) -> None:
        session = sessions[s]
        prompt = history + session.turns[t].user
        name = router.choose(RouteRequest(prompt, session.namespace), loads)
        loads[name] += 1
        routed[name] += 1
        request_id = len(turn_of)
        turn_of[request_id] = (s, t)
        params = SamplingParams(max_new_tokens=session.turns[t].max_new_tokens)
        scheds[name].add(Request(request_id, prompt, params, session.namespace))

    while arrivals or follow or any(sched.has_work for sched in scheds.values()):
        drain()
        index_max = max(index_max, index.num_hashes)
        if follow or (arrivals and arrivals[0][0] <= step):
            loads = {name: sched.num_waiting + sched.num_running for name, sched in scheds.items()}
            for s, t, history in follow:
                route(s, t, history, loads)
            follow = []
            while arrivals and arrivals[0][0] <= step:
                _, s = heapq.heappop(arrivals)
                route(s, 0, list(sessions[s].prefix), loads)
        ran = False
        for sched in scheds.values():
            batch = sched.schedule()
            if batch is None:
                continue
            ran = True
            tokens = []
            for entry in batch.entries:
                if entry.sample:
                    s, t = turn_of[entry.request.id]
                    tokens.append(reply_token(s, t, len(entry.request.output)))
                else:
                    tokens.append(-1)
            for request in sched.commit(batch, tokens):
                s, t = turn_of[request.id]
                if t + 1 < len(sessions[s].turns):
                    follow.append((s, t + 1, request.prompt + request.output))
        if not ran and not follow:
            if any(sched.has_work for sched in scheds.values()):
                raise RuntimeError("simulate_cluster: work left but nothing scheduled")
            if arrivals:
                step = max(step + 1, arrivals[0][0])
                continue
        step += 1
    drain()
    index_max = max(index_max, index.num_hashes)
    for sched in scheds.values():
        sched.check_integrity()
    index.check()
    if keep is not None:
        keep.extend([router, index, [(n, scheds[n], publishers[n]) for n in names]])

    counters = [sched.counters for sched in scheds.values()]
    prompt_tokens = sum(c.prompt_tokens for c in counters)
    cached = sum(c.cached_tokens for c in counters)
    hit_rate = cached / prompt_tokens if prompt_tokens else 0.0
    per_replica = [routed[name] for name in names]
    mean = sum(per_replica) / replicas
    return ClusterResult(
        trace=trace.name,
        router=router_name,
        replicas=replicas,
        pages_per_replica=pages_per_replica,
        requests=sum(c.requests for c in counters),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        hit_rate=hit_rate,
        ideal_hit_rate=stats.ideal_hit_rate,
        hit_ratio=hit_rate / stats.ideal_hit_rate if stats.ideal_hit_rate else 1.0,
        requests_per_replica=per_replica,
        imbalance=max(per_replica) / mean if mean else 1.0,
        steps=step,
        evicted_pages=sum(c.evicted_pages for c in counters),
        index_max_hashes=index_max,
        balanced=getattr(router, "balanced", 0),
        wall_s=time.perf_counter() - started,
    )


def replica_pages(stats: TraceStats, replicas: int, capacity: float) -> int:
    """Each replica's share of ``capacity`` x the working set, never less than two largest
    requests."""
    return max(int(stats.working_set_pages * capacity / replicas), 2 * stats.largest_request_pages)


def format_table(results: Sequence[ClusterResult]) -> str:
    header = (
        f"{'trace':<12}{'N':>4}{'router':>14}{'pages/rep':>10}{'requests':>9}{'hit':>7}"
        f"{'ideal':>7}{'hit/ideal':>10}{'imbalance':>10}{'balanced':>9}{'steps':>7}"
        f"{'evicted':>9}{'index max':>10}{'wall s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.trace:<12}{r.replicas:>4}{r.router:>14}{r.pages_per_replica:>10}"
            f"{r.requests:>9}{r.hit_rate:>7.3f}{r.ideal_hit_rate:>7.3f}{r.hit_ratio:>10.3f}"
            f"{r.imbalance:>10.2f}{r.balanced:>9}{r.steps:>7}{r.evicted_pages:>9}"
            f"{r.index_max_hashes:>10}{r.wall_s:>8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    traces = {**CLUSTER_TRACES, **TRACES}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", nargs="+", type=int, required=True)
    parser.add_argument("--router", nargs="+", default=["all"], choices=[*ROUTERS, "all"])
    parser.add_argument("--traces", nargs="+", default=list(CLUSTER_TRACES), choices=list(traces))
    parser.add_argument(
        "--capacity",
        type=float,
        default=1.0,
        help="fraction of the trace's working set the whole cluster holds, split evenly",
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
            pages = replica_pages(stats, n, args.capacity)
            for router in routers:
                result = simulate_cluster(
                    trace,
                    router,
                    n,
                    pages,
                    args.page_size,
                    stats,
                    balance_threshold=args.balance_threshold,
                    pending_ttl=args.pending_ttl,
                )
                results.append(result)
                print(format_table([result]).splitlines()[-1], flush=True)
    report(results, format_table, args.json)


if __name__ == "__main__":
    main()
