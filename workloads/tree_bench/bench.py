"""Micro-benchmark of RadixCache on synthetic traces: ``python -m workloads.tree_bench``.

Replays each trace as an engine would (``workloads.tree_bench.replay``) at several capacities
and page sizes, and prints hit rates next to the ideal (infinite cache) and a per-page LRU,
with median / p99 microseconds per match_prefix, insert and evict. Prompts are passed as int32
numpy arrays (the fast path); the cost of passing Python lists is printed separately.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from radix.cache import RadixCache
from workloads.tree_bench.replay import (
    per_page_lru_hit_rate,
    replay,
    unique_pages,
    whole_leaf_hit_rate,
)
from workloads.tree_bench.requests import TRACES, TraceRequest


def _us(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.quantile(np.asarray(values), q)) / 1000.0


@dataclass(slots=True)
class Row:
    trace: str
    page_size: int
    capacity: str
    hit: float
    ideal: float
    lru_hit: float | None
    whole_leaf_hit: float | None
    cells: dict[str, float]


def bench_config(
    name: str, trace: list[TraceRequest], page_size: int, fraction: float, repeats: int
) -> Row:
    total = unique_pages(trace, page_size)
    largest = max((len(r.prompt) + len(r.reply)) // page_size for r in trace)
    capacity = max(int(total * fraction), largest)
    runs = [replay(trace, page_size, capacity) for _ in range(repeats)]
    ideal = replay(trace, page_size, total).hit_rate if fraction < 1.0 else runs[0].hit_rate
    cells: dict[str, float] = {}
    for op in ("match", "insert", "evict"):
        for label, q in (("p50", 0.5), ("p99", 0.99)):
            cells[f"{op}_{label}"] = statistics.median(_us(getattr(r, f"{op}_ns"), q) for r in runs)
    cells["evict_per_step"] = statistics.median(_us(r.evict_ns_per_step, 0.5) for r in runs)
    pressure = fraction < 1.0
    lru = per_page_lru_hit_rate(trace, page_size, capacity) if pressure else None
    whole = whole_leaf_hit_rate(trace, page_size, capacity) if pressure else None
    return Row(name, page_size, f"{fraction:g}x", runs[0].hit_rate, ideal, lru, whole, cells)


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'trace':<14} {'p':>3} {'cap':>5} {'hit':>6} {'ideal':>6} {'lru':>6} {'whole':>6} | "
        f"{'match p50/p99':>15} | {'insert p50/p99':>15} | {'evict p50/p99':>15} | {'us/step':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r.cells
        lru = f"{r.lru_hit:6.3f}" if r.lru_hit is not None else f"{'-':>6}"
        whole = f"{r.whole_leaf_hit:6.3f}" if r.whole_leaf_hit is not None else f"{'-':>6}"
        lines.append(
            f"{r.trace:<14} {r.page_size:>3} {r.capacity:>5} {r.hit:6.3f} {r.ideal:6.3f} {lru} "
            f"{whole} | "
            f"{c['match_p50']:6.1f} / {c['match_p99']:6.1f} | "
            f"{c['insert_p50']:6.1f} / {c['insert_p99']:6.1f} | "
            f"{c['evict_p50']:6.1f} / {c['evict_p99']:6.1f} | {c['evict_per_step']:7.2f}"
        )
    return "\n".join(lines)


def list_input_overhead(repeats: int = 2000) -> str:
    """Match cost of a 2,100-token prompt passed as a list versus an int32 array."""
    trace = TRACES["shared-prefix"]()
    cache = RadixCache(16)
    for req in trace[:64]:
        full = np.concatenate([req.prompt, req.reply])
        cache.insert(full, list(range(len(full) // 16)))
    prompt = trace[0].prompt
    as_list = prompt.tolist()

    def timed(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - t0)
        return statistics.median(samples) / 1000.0

    array_us = timed(lambda: cache.match_prefix(prompt))
    list_us = timed(lambda: cache.match_prefix(as_list))
    return (
        f"match_prefix, 2,100-token prompt, p=16: int32 array {array_us:.1f} us, "
        f"list[int] {list_us:.1f} us (median of {repeats})"
    )


def evict_scaling(sizes: tuple[int, ...] = (1_000, 10_000, 100_000), samples: int = 2000) -> str:
    """Median cost of evicting one whole 4-page leaf from trees of growing size (p=16)."""
    rng = np.random.default_rng(4)
    parts = []
    for size in sizes:
        cache = RadixCache(16)
        tokens = rng.integers(0, 32_000, size=(size + samples, 64), dtype=np.int32)
        for i, row in enumerate(tokens):
            cache.insert(row, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3])
        timings = []
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            cache.evict(4)
            timings.append(time.perf_counter_ns() - t0)
        parts.append(f"{size:,} leaves {statistics.median(timings) / 1000:.1f} us")
    return "evict(4) of one 4-page leaf, median: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.tree_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--traces", nargs="*", default=list(TRACES), choices=list(TRACES))
    parser.add_argument("--page-sizes", nargs="*", type=int, default=[1, 16])
    parser.add_argument("--capacities", nargs="*", type=float, default=[1.0, 0.25, 0.1])
    parser.add_argument("--repeats", type=int, default=3, help="replays per config (medians)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.traces:
        trace = TRACES[name]()
        for page_size in args.page_sizes:
            for fraction in args.capacities:
                rows.append(bench_config(name, trace, page_size, fraction, args.repeats))
                print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(
        "hit = cached prompt tokens / prompt tokens; ideal = infinite cache; lru = per-page LRU"
        " at the same capacity; whole = the same tree evicting whole leaves; times in us (median over repeats of per-run p50 / p99);"
        " us/step = median over evict calls of time per leaf removed or shrunk. Prompts passed as int32 arrays;"
        " GC paused during replays."
    )
    print(format_table(rows))
    print(list_input_overhead())
    print(evict_scaling())


if __name__ == "__main__":
    main()
