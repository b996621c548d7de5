"""One engine in the cache-only simulator: a trace through one real Scheduler, no model.

The loop is the simulators' one (``loop.run_closed_loop``, N = 1). What a step costs is
counted, not timed: prefill tokens computed, decode tokens, steps; the ideal hit rate is the
trace's (``stats.trace_stats``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from radix import KVManager
from scheduler import Scheduler, SchedulerConfig
from workloads.simulators.loop import run_closed_loop
from workloads.simulators.stats import TraceStats, trace_stats
from workloads.traces.synthetic import SimTrace


@dataclass
class SimResult:
    trace: str
    policy: str
    capacity: float  # fraction of the working set the pool holds
    pages: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    computed_prefill_tokens: int
    decode_tokens: int
    steps: int
    preemptions: int
    evicted_pages: int
    hit_rate: float
    ideal_hit_rate: float
    wall_s: float


def simulate(
    trace: SimTrace,
    policy: str,
    num_pages: int,
    page_size: int = 16,
    stats: TraceStats | None = None,
    **config: object,
) -> SimResult:
    """Run ``trace`` to completion through a Scheduler over a ``num_pages`` pool."""
    stats = stats if stats is not None else trace_stats(trace, page_size)
    started = time.perf_counter()
    sched_config = SchedulerConfig(page_size=page_size, policy=policy, **config)
    kv = KVManager(num_pages, page_size, sched_config.prefix_cache)
    sched = Scheduler(kv, sched_config)
    loop = run_closed_loop(trace, {"engine": sched})
    sched.check_integrity()
    counters = sched.counters
    return SimResult(
        trace=trace.name,
        policy=policy,
        capacity=num_pages / stats.working_set_pages,
        pages=num_pages,
        requests=counters.requests,
        prompt_tokens=counters.prompt_tokens,
        cached_tokens=counters.cached_tokens,
        computed_prefill_tokens=counters.computed_prefill_tokens,
        decode_tokens=loop.decode_tokens,
        steps=counters.steps,
        preemptions=counters.preemptions,
        evicted_pages=counters.evicted_pages,
        hit_rate=counters.hit_rate,
        ideal_hit_rate=stats.ideal_hit_rate,
        wall_s=time.perf_counter() - started,
    )


def format_table(results: Sequence[SimResult]) -> str:
    header = (
        f"{'trace':<14}{'policy':<11}{'capacity':>9}{'pages':>8}{'requests':>9}"
        f"{'prompt tok':>12}{'prefill computed':>17}{'hit':>7}{'ideal':>7}{'hit/ideal':>10}"
        f"{'steps':>7}{'preempt':>8}{'evicted':>9}{'wall s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        ratio = r.hit_rate / r.ideal_hit_rate if r.ideal_hit_rate else 1.0
        lines.append(
            f"{r.trace:<14}{r.policy:<11}{r.capacity:>9.2f}{r.pages:>8}{r.requests:>9}"
            f"{r.prompt_tokens:>12,}{r.computed_prefill_tokens:>17,}{r.hit_rate:>7.3f}"
            f"{r.ideal_hit_rate:>7.3f}{ratio:>10.3f}{r.steps:>7}{r.preemptions:>8}"
            f"{r.evicted_pages:>9}{r.wall_s:>8.2f}"
        )
    return "\n".join(lines)
