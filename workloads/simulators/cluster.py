"""N replicas in the cache-only simulator: real Schedulers behind one router, no model.

Each replica is a ``Scheduler`` over its own ``KVManager`` with a ``KVEventPublisher``
attached; the router keeps a ``KVIndex`` fed at the start of every step from every replica's
publisher, so the events of step k reach it at step k+1, as they would in a deployment. The
loop is the simulators' one (``loop.run_closed_loop``): the requests arriving now are routed
(first turns at their session's arrival, later turns the step after the previous turn
finished), with each replica's load = its waiting + running requests; then every replica runs
one step with the scripted model's replies. The ideal hit rate is one infinite cache
(``stats.trace_stats``).

    python -m workloads.simulate --replicas 2 8 64 --router all --traces tenants rag_corpus
"""

from __future__ import annotations

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
from scheduler import Scheduler, SchedulerConfig
from workloads.simulators.loop import run_closed_loop
from workloads.simulators.stats import TraceStats, trace_stats
from workloads.traces.synthetic import SimTrace

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
    clock = 0  # the router's clock: the loop's step
    router = make_router(
        router_name,
        index,
        page_size,
        lambda: clock,
        balance_threshold,
        pending_ttl,
        seed,
        balance_window,
    )
    index_max = 0

    def drain() -> None:
        """Every replica's events since the last drain into the index (a resync on a gap)."""
        nonlocal index_max
        for name, publisher in publishers.items():
            sched = scheds[name]
            batch = publisher.drain(sched.num_waiting + sched.num_running)
            if batch is not None and not index.apply(batch):
                index.resync(publisher.snapshot())
        index_max = max(index_max, index.num_hashes)

    def start_step(step: int) -> None:
        nonlocal clock
        clock = step
        drain()

    def place(prompt: list[int], namespace: str | None, loads: dict[str, int]) -> str:
        return router.choose(RouteRequest(prompt, namespace), loads)

    loop = run_closed_loop(trace, scheds, place, start_step)
    drain()
    for sched in scheds.values():
        sched.check_integrity()
    index.check()
    if keep is not None:
        keep.extend([router, index, [(n, scheds[n], publishers[n]) for n in names]])

    counters = [sched.counters for sched in scheds.values()]
    prompt_tokens = sum(c.prompt_tokens for c in counters)
    cached = sum(c.cached_tokens for c in counters)
    hit_rate = cached / prompt_tokens if prompt_tokens else 0.0
    per_replica = [loop.placed[name] for name in names]
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
        steps=loop.steps,
        evicted_pages=sum(c.evicted_pages for c in counters),
        index_max_hashes=index_max,
        balanced=getattr(router, "balanced", 0),
        wall_s=time.perf_counter() - started,
    )


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
