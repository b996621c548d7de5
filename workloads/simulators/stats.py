"""What any run of a trace must compute with an infinite cache, and its footprint in pages:
the yardstick every simulated result is read against, and the pool sizes it sets.

The ideal hit rate is that of an infinite cache with perfect grouping: a prompt page hits if
any earlier request (in submission order, same namespace) computed it.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.simulators.script import expand
from workloads.traces.synthetic import SimTrace


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


def pool_pages(stats: TraceStats, fraction: float, replicas: int = 1) -> int:
    """Each of ``replicas`` pools: its even share of ``fraction`` x the working set, never
    less than two largest requests."""
    return max(
        int(stats.working_set_pages * fraction / replicas), 2 * stats.largest_request_pages
    )
