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
import heapq
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from radix import KVManager
from scheduler import POLICIES, Request, SamplingParams, Scheduler, SchedulerConfig
from workloads.synthetic import TRACES, VOCAB, SimTrace


def reply_token(session: int, turn: int, index: int) -> int:
    """The simulated model's ``index``-th reply token to a session's turn."""
    return (session * 1_000_003 + turn * 10_007 + index * 7_919 + 12_345) % VOCAB


def reply(session: int, turn: int, length: int) -> list[int]:
    return [reply_token(session, turn, i) for i in range(length)]


def expand(trace: SimTrace) -> list[tuple[int, int, list[int], list[int]]]:
    """Every request as (session, turn, prompt, reply), in submission order (arrival, turn)."""
    out = []
    for s, session in enumerate(trace.sessions):
        history = list(session.prefix)
        for t, turn in enumerate(session.turns):
            prompt = history + turn.user
            answer = reply(s, t, turn.max_new_tokens)
            out.append((session.arrival + t, s, t, prompt, answer))
            history = prompt + answer
    out.sort(key=lambda item: (item[0], item[1], item[2]))
    return [(s, t, prompt, answer) for _, s, t, prompt, answer in out]


@dataclass
class TraceStats:
    """What any run of the trace must compute with an infinite cache, and its footprint."""

    requests: int
    prompt_tokens: int
    ideal_cached_tokens: int
    working_set_pages: int  # distinct KV pages all requests produce (prompt + reply)
    largest_request_pages: int

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def trace_stats(trace: SimTrace, page_size: int) -> TraceStats:
    seen: set[tuple[str | None, int]] = set()
    prompt_tokens = cached = largest = 0
    namespaces = [session.namespace for session in trace.sessions]
    for s, _t, prompt, answer in expand(trace):
        namespace = namespaces[s]
        prompt_tokens += len(prompt)
        cap = ((len(prompt) - 1) // page_size) * page_size
        tokens = prompt + answer[:-1]  # the last reply token never gets K/V
        largest = max(largest, -(-(len(prompt) + len(answer) - 1) // page_size))
        chain = 0
        hit = True
        for start in range(0, len(tokens) - page_size + 1, page_size):
            chain = hash((chain, tuple(tokens[start : start + page_size])))
            key = (namespace, chain)
            if hit and start + page_size <= cap and key in seen:
                cached += page_size
            else:
                hit = False
            seen.add(key)
    return TraceStats(len(expand(trace)), prompt_tokens, cached, len(seen), largest)


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
    sessions = trace.sessions
    arrivals = [(session.arrival, s) for s, session in enumerate(sessions)]
    heapq.heapify(arrivals)
    turn_of: dict[int, tuple[int, int]] = {}  # request id -> (session, turn)

    def submit(s: int, t: int, history: list[int]) -> None:
        turn = sessions[s].turns[t]
        request_id = len(turn_of)
        turn_of[request_id] = (s, t)
        params = SamplingParams(max_new_tokens=turn.max_new_tokens)
        sched.add(Request(request_id, history + turn.user, params, sessions[s].namespace))

    step = 0
    decode_tokens = 0
    while arrivals or sched.has_work:
        while arrivals and arrivals[0][0] <= step:
            _, s = heapq.heappop(arrivals)
            submit(s, 0, list(sessions[s].prefix))
        batch = sched.schedule()
        if batch is None:
            if arrivals:
                step = max(step + 1, arrivals[0][0])
                continue
            raise RuntimeError("simulate: work left but nothing scheduled")
        tokens = []
        for entry in batch.entries:
            if entry.sample:
                s, t = turn_of[entry.request.id]
                tokens.append(reply_token(s, t, len(entry.request.output)))
            else:
                tokens.append(-1)
        decode_tokens += batch.num_decode
        for request in sched.commit(batch, tokens):
            s, t = turn_of[request.id]
            if t + 1 < len(sessions[s].turns):
                submit(s, t + 1, request.prompt + request.output)
        step += 1
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
        decode_tokens=decode_tokens,
        steps=counters.steps,
        preemptions=counters.preemptions,
        evicted_pages=counters.evicted_pages,
        hit_rate=counters.hit_rate,
        ideal_hit_rate=stats.ideal_hit_rate,
        wall_s=time.perf_counter() - started,
    )


def pool_pages(stats: TraceStats, fraction: float) -> int:
    """A pool holding ``fraction`` of the working set, never less than two largest requests."""
    return max(int(stats.working_set_pages * fraction), 2 * stats.largest_request_pages)


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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--replicas" in argv:  # many replicas behind a router: workloads.simulate_cluster
        from workloads.simulate_cluster import main as cluster_main

        cluster_main(argv)
        return
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="A cluster of replicas behind a router: --replicas N [N ...] [--router NAME ...] "
        "(workloads.simulate_cluster; 'python -m workloads.simulate --replicas 2 --help' lists "
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


def report(results: Sequence[Any], table: Callable[[Sequence[Any]], str],
           json_path: str | None) -> None:
    """Print every result as one table; also write them to ``json_path`` when given."""
    print()
    print(table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
