"""N replicas in the cache-only simulator: real Schedulers behind one router, no model.

Each replica is a ``Scheduler`` over its own ``KVManager`` with a ``KVEventPublisher``
attached; the router keeps a ``KVIndex`` fed at the start of every step from every replica's
publisher, so the events of step k reach it at step k+1, as they would in a deployment. The
loop is the simulators' one (``loop.run_closed_loop``): the requests arriving now are routed
(first turns at their session's arrival, later turns the step after the previous turn
finished), with each replica's load = its waiting + running requests; then every replica runs
one step with the scripted model's replies. The ideal hit rate is one infinite cache
(``stats.trace_stats``).

With ``host_pages``/``disk_pages`` each replica's pool has KV tiers under it (``tiers``): the
events then say where each page is, and a later turn's prompt is counted by where its cached
part came from (pool, or loaded from below) and by whether it went to a replica holding the
most of it (``routing_accuracy``, from the replicas' own state at routing time). With
``remote_pages`` every replica also has the remote tier over one store of that many pages
(``tiers.SharedPages``), written as trees gain pages, flushed every step; the router counts
its pages held by every replica at the remote cost.

    python -m workloads.simulate --replicas 2 8 64 --router all --traces tenants rag_corpus
    python -m workloads.simulate --replicas 2 4 --traces think_chat --capacity 0.03 \
        --host-capacity 0.1 --disk-capacity 0.5 \
        --router cache_aware cache_aware_pool_only least_loaded
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
from cluster.events import kv_places
from cluster.policy import DEFAULT_TIER_COST, reusable_chain
from radix import KVManager
from scheduler import Scheduler, SchedulerConfig
from workloads.simulators.loop import run_closed_loop
from workloads.simulators.stats import TraceStats, trace_stats
from workloads.simulators.tiers import SimTiers
from workloads.traces.synthetic import SimTrace

ROUTERS = ("cache_aware", "text_prefix", "round_robin", "least_loaded")
assert set(ROUTERS) == set(POLICY_NAMES)
# cache_aware blind to the tiers below the pool (a page there counts as missing): the router
# before the KV events said where pages are, kept to measure against
POOL_ONLY = "cache_aware_pool_only"
SIM_ROUTERS = (*ROUTERS, POOL_ONLY)

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
    # Turns after a session's first: prompt tokens served from the pool, and loaded from below
    host_pages_per_replica: int = 0
    disk_pages_per_replica: int = 0
    later_requests: int = 0
    later_pool_hit_rate: float = 0.0
    later_below_hit_rate: float = 0.0
    # Later turns where the replicas' own state differed (some held more of the prompt than
    # another, in any place), and the share of those sent to one holding the most
    routing_decisive: int = 0
    routing_accuracy: float = 1.0
    written_below: int = 0  # pages written to host memory or disk, all replicas
    loaded_below: int = 0  # pages loaded back from host memory or disk
    dropped_below: int = 0  # pages that fell off the last tier
    remote_pages: int = 0  # the shared store's budget (0: no remote tier)
    remote_hit_rate: float = 0.0  # prompt tokens loaded from the shared store / prompt tokens
    loaded_remote: int = 0  # pages loaded from the shared store, all replicas


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
    if name in ("cache_aware", POOL_ONLY):
        return CacheAware(
            index,
            page_size,
            balance_threshold,
            pending_ttl,
            seed,
            clock,
            window_s=balance_window,
            tier_cost=DEFAULT_TIER_COST if name == "cache_aware" else None,
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
    host_pages: int = 0,
    disk_pages: int = 0,
    remote_pages: int = 0,
    **config: object,
) -> ClusterResult:
    """Run ``trace`` to completion on ``replicas`` replicas of ``pages_per_replica`` pages,
    each over ``host_pages`` of host memory and ``disk_pages`` of disk, all over one remote
    store of ``remote_pages`` (0: no such tier).

    ``keep``, when given, receives the router, the index, the (name, scheduler, publisher)
    triples and each later turn's (session, turn, chosen replica, true runs by replica), for
    tests to inspect."""
    stats = stats if stats is not None else trace_stats(trace, page_size)
    started = time.perf_counter()
    sched_config = SchedulerConfig(page_size=page_size, **config)  # type: ignore[arg-type]
    names = [f"r{i:02d}" for i in range(replicas)]
    scheds: dict[str, Scheduler] = {}
    publishers: dict[str, KVEventPublisher] = {}
    index = KVIndex()
    below = SimTiers(page_size, host_pages, disk_pages, remote_pages)
    for i, name in enumerate(names):
        kv = KVManager(
            pages_per_replica, page_size, sched_config.prefix_cache, tiers=below.make(name)
        )
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
        below.settle()
        drain()

    decisive = accurate = 0
    routed: list[tuple[str, dict[str, int]]] = []

    def place(prompt: list[int], namespace: str | None, loads: dict[str, int], turn: int) -> str:
        nonlocal decisive, accurate
        chosen = router.choose(RouteRequest(prompt, namespace), loads)
        if turn:
            chain = reusable_chain(prompt, page_size, namespace)
            runs = {name: held_run(publishers[name], chain) for name in names}
            if keep is not None:
                routed.append((chosen, runs))
            if max(runs.values()) > min(runs.values()):
                decisive += 1
                accurate += runs[chosen] == max(runs.values())
        return chosen

    try:
        loop = run_closed_loop(trace, scheds, place, start_step)
        drain()
        for name, sched in scheds.items():
            sched.check_integrity()
            check_accounted(index, name, sched.kv)
        index.check()
        tier_stats = [s for s in (sched.kv.tier_stats() for sched in scheds.values()) if s]
    finally:
        below.close()
    if keep is not None:
        keep.extend([router, index, [(n, scheds[n], publishers[n]) for n in names], routed])

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
        host_pages_per_replica=host_pages,
        disk_pages_per_replica=disk_pages,
        later_requests=loop.later_turns.requests,
        later_pool_hit_rate=loop.later_turns.pool_hit_rate,
        later_below_hit_rate=loop.later_turns.below_hit_rate,
        routing_decisive=decisive,
        routing_accuracy=accurate / decisive if decisive else 1.0,
        written_below=sum(t.written_host + t.written_disk for t in tier_stats),
        loaded_below=sum(t.loaded_host + t.loaded_disk for t in tier_stats),
        dropped_below=sum(t.dropped for t in tier_stats),
        remote_pages=remote_pages,
        remote_hit_rate=(
            sum(c.cached_tokens_remote for c in counters) / prompt_tokens if prompt_tokens else 0.0
        ),
        loaded_remote=sum(t.loaded_remote for t in tier_stats),
    )


def held_run(publisher: KVEventPublisher, chain: Sequence[int]) -> int:
    """Leading pages of ``chain`` the publisher's replica holds now, in any place."""
    n = 0
    while n < len(chain) and publisher.where(chain[n]) is not None:
        n += 1
    return n


def check_accounted(index: KVIndex, name: str, kv: KVManager) -> None:
    """Every page of the replica, in the pool, host memory or on disk, is in the index at its
    best place, and nothing else is (AssertionError)."""
    truth = kv_places(kv)
    view = index.view(name)
    assert view is not None and not view.stale, f"{name}: not followed"
    assert view.hashes == truth.keys(), f"{name}: index and replica hold different pages"
    wrong = [h for h, tier in truth.items() if view.where(h) is not tier]
    assert not wrong, f"{name}: {len(wrong)} pages indexed in the wrong place"


def format_table(results: Sequence[ClusterResult]) -> str:
    header = (
        f"{'trace':<12}{'N':>4}{'router':>23}{'pages/rep':>10}{'remote':>8}{'requests':>9}"
        f"{'hit':>7}{'of it remote':>13}{'ideal':>7}{'hit/ideal':>10}{'imbalance':>10}"
        f"{'balanced':>9}{'steps':>7}{'evicted':>9}{'index max':>10}{'wall s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.trace:<12}{r.replicas:>4}{r.router:>23}{r.pages_per_replica:>10}"
            f"{r.remote_pages:>8}{r.requests:>9}{r.hit_rate:>7.3f}{r.remote_hit_rate:>13.3f}"
            f"{r.ideal_hit_rate:>7.3f}{r.hit_ratio:>10.3f}"
            f"{r.imbalance:>10.2f}{r.balanced:>9}{r.steps:>7}{r.evicted_pages:>9}"
            f"{r.index_max_hashes:>10}{r.wall_s:>8.2f}"
        )
    return "\n".join(lines)


def format_turns_table(results: Sequence[ClusterResult]) -> str:
    """Later turns: where their cached tokens came from, and whether the router sent them to
    a replica holding the most of their prompt."""
    header = (
        f"{'trace':<12}{'N':>3}{'router':>23}{'pool/host/disk':>17}{'later':>7}"
        f"{'pool hit':>9}{'tier hit':>9}{'hit':>7}{'decisive':>9}{'to holder':>10}"
        f"{'imbalance':>10}{'loaded':>8}{'dropped':>8}{'steps':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        sizes = f"{r.pages_per_replica}/{r.host_pages_per_replica}/{r.disk_pages_per_replica}"
        hit = r.later_pool_hit_rate + r.later_below_hit_rate
        lines.append(
            f"{r.trace:<12}{r.replicas:>3}{r.router:>23}{sizes:>17}{r.later_requests:>7}"
            f"{r.later_pool_hit_rate:>9.3f}{r.later_below_hit_rate:>9.3f}{hit:>7.3f}"
            f"{r.routing_decisive:>9}{r.routing_accuracy:>10.3f}{r.imbalance:>10.2f}"
            f"{r.loaded_below:>8}{r.dropped_below:>8}{r.steps:>7}"
        )
    return "\n".join(lines)
