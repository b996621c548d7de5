"""KV tiers under pressure (``python -m workloads.bench --tiers``).

Per workload (``rag``, ``sessions``): the pool unbounded (the reference hit rate), then the
pool at a tenth of the working set (distinct prompt pages of the unbounded run, at least two
of the longest request) with the tiers off, a host tier that holds the working set, and a
host tier as small as the pool over a disk tier (the disk serves most loads). Configurations
run interleaved (A B C D, A B C D, ...: the CPU's speed drifts), medians over repeats. Then a
warm restart: the first requests' time to first token on an engine started on an empty disk
directory (cold) against one started on the directory a previous engine closed (warm).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from typing import Any

import msgspec

from workloads.engine_bench.metrics import RunMetrics, median_metrics, run_metrics
from workloads.engine_bench.runner import RunResult, run_trace
from workloads.traces.ideal import PageTrie
from workloads.traces.prompts import SessionPrompts
from workloads.traces.trace import Trace

TIER_WORKLOADS = ("rag", "sessions")
# Sizes for the tier runs (``--set`` overrides them): a working set of ~500-800 pages, so a
# tenth of it still holds two of the longest requests. RAG requests arrive over time (about
# what the small pool serves): sent all at once, the scheduler groups each document's
# requests and computes it once, and even a pool of a tenth misses nothing (measured
# 2026-11-23: 99% of the unbounded hit rate with the tiers off).
TIER_DEFAULTS: dict[str, dict[str, Any]] = {
    "rag": {"documents": 24, "doc_tokens": 384, "requests": 48, "max_new_tokens": 16,
            "arrival_rate": 0.8},
    "sessions": {"users": 20},
}
POOL_FRACTION = 0.1
RESTART_REQUESTS = 8


class TierConfig(msgspec.Struct, frozen=True):
    name: str
    num_pages: int | None  # None: the engine's default budget (the unbounded reference)
    kv_host_bytes: int | None = None
    kv_disk: bool = False


class TierResult(msgspec.Struct):
    config: TierConfig
    runs: list[RunMetrics]
    median: RunMetrics
    of_unbounded_hit: float  # median hit rate / the unbounded pool's
    wall_vs_off: float | None  # median over repeats of wall(tiers off) / wall(this)


class RestartResult(msgspec.Struct):
    requests: int
    cold_ttft_s: list[float]  # median per request over repeats, in send order
    warm_ttft_s: list[float]
    cold_cached_tokens: int
    warm_cached_tokens: int
    warm_disk_tokens: int


class TierWorkloadResult(msgspec.Struct):
    workload: str
    seed: int
    params: dict[str, Any]
    working_set_pages: int
    configs: list[TierResult]
    restart: RestartResult | None


def working_set(result: RunResult, page_size: int) -> tuple[int, int]:
    """(distinct whole prompt pages of a run, pages of its longest request)."""
    trie = PageTrie(page_size)
    pages = longest = 0
    for record in result.records:
        pages += (len(record.prompt_ids) - trie.match(record.prompt_ids)) // page_size
        trie.insert(record.prompt_ids)
        size = len(record.prompt_ids) + len(record.output_ids)
        longest = max(longest, math.ceil(size / page_size))
    return pages, longest


def _engine(loaded: Any, args: argparse.Namespace, config: TierConfig, disk_dir: str | None):
    from engine import Engine

    return Engine(
        model=loaded, page_size=args.page_size, num_pages=config.num_pages,
        policy=args.policy[0], threads=args.torch_threads,
        kv_host_bytes=config.kv_host_bytes, kv_disk_dir=disk_dir,
    )


def _run(loaded: Any, args: argparse.Namespace, config: TierConfig, trace: Trace) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="radixkv-tiers-") as tmp:
        engine = _engine(loaded, args, config, tmp if config.kv_disk else None)
        try:
            return run_trace(engine, trace, loaded.tokenizer)
        finally:
            engine.close()


def bench_tiers(trace: Trace, loaded: Any, args: argparse.Namespace) -> TierWorkloadResult:
    from engine import KVPool

    cfg = loaded.config
    page_bytes = KVPool.bytes_per_page(
        cfg.num_layers, args.page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
    )
    unbounded = TierConfig("unbounded", None)
    first = _run(loaded, args, unbounded, trace)
    pages, longest = working_set(first, args.page_size)
    small = max(math.ceil(pages * POOL_FRACTION), 2 * longest)
    configs = [
        unbounded,
        TierConfig("tiers off", small),
        TierConfig("host", small, kv_host_bytes=2 * pages * page_bytes),
        TierConfig("host+disk", small, kv_host_bytes=small * page_bytes, kv_disk=True),
    ]
    runs: dict[str, list[RunResult]] = {c.name: [] for c in configs}
    runs["unbounded"].append(first)
    for repeat in range(args.repeats):
        for config in configs:
            if config is unbounded and repeat == 0:
                continue
            runs[config.name].append(_run(loaded, args, config, trace))
    metrics = {name: [run_metrics(r, args.page_size) for r in rs] for name, rs in runs.items()}
    ref_hit = median_metrics(metrics["unbounded"]).hit_rate
    results = []
    for config in configs:
        ms = metrics[config.name]
        median = median_metrics(ms)
        wall_vs_off = None
        if config.num_pages is not None:
            wall_vs_off = statistics.median(
                o.wall_s / m.wall_s for o, m in zip(metrics["tiers off"], ms)
            )
        of_unbounded = median.hit_rate / ref_hit if ref_hit else 0.0
        results.append(TierResult(config, ms, median, of_unbounded, wall_vs_off))
    restart = warm_restart(trace, loaded, args)
    return TierWorkloadResult(
        trace.workload, trace.seed, trace.params, pages, results, restart
    )


def warm_restart(trace: Trace, loaded: Any, args: argparse.Namespace) -> RestartResult:
    """TTFT of the first requests (one at a time) after a restart: empty disk vs warm."""
    from engine import SamplingParams

    prompts = [
        SessionPrompts(s, trace, loaded.tokenizer).prompt() for s in trace.sessions
    ][:RESTART_REQUESTS]
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    config = TierConfig("restart", None)
    cold_ttft: list[list[float]] = []
    warm_ttft: list[list[float]] = []
    cached = {"cold": 0, "warm": 0, "disk": 0}
    with tempfile.TemporaryDirectory(prefix="radixkv-warm-") as warm_dir:
        engine = _engine(loaded, args, config, warm_dir)
        try:
            run_trace(engine, trace, loaded.tokenizer)
        finally:
            engine.close()  # writes the pool down: the warm directory
        for _ in range(args.repeats):
            for mode in ("cold", "warm"):
                with tempfile.TemporaryDirectory(prefix="radixkv-cold-") as cold_dir:
                    engine = _engine(loaded, args, config, warm_dir if mode == "warm" else cold_dir)
                    try:
                        outs = [engine.generate([p], params)[0] for p in prompts]
                        stats = engine.stats()
                    finally:
                        engine.close()
                (warm_ttft if mode == "warm" else cold_ttft).append(
                    [o.ttft_s or 0.0 for o in outs]
                )
                cached[mode] = sum(o.cached_tokens for o in outs)
                if mode == "warm":
                    cached["disk"] = stats.counters.cached_tokens_disk
    return RestartResult(
        len(prompts),
        [statistics.median(col) for col in zip(*cold_ttft)],
        [statistics.median(col) for col in zip(*warm_ttft)],
        cached["cold"], cached["warm"], cached["disk"],
    )


def format_tier_table(result: TierWorkloadResult, page_bytes: int | None = None) -> str:
    head = ("config", "pool pages", "host MB", "disk", "hit", "of unbounded", "from host",
            "from disk", "computed", "wall s", "ttft p50", "wall vs off")
    rows = []
    for item in result.configs:
        c, m = item.config, item.median
        rows.append((
            c.name, str(c.num_pages or "default"),
            "-" if not c.kv_host_bytes else f"{c.kv_host_bytes / 2**20:.0f}",
            "yes" if c.kv_disk else "-", f"{m.hit_rate:.1%}", f"{item.of_unbounded_hit:.0%}",
            str(m.cached_host_tokens), str(m.cached_disk_tokens),
            str(m.computed_prefill_tokens), f"{m.wall_s:.1f}", f"{m.ttft_p50_s:.2f}",
            "" if item.wall_vs_off is None else f"{item.wall_vs_off:.2f}x",
        ))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    params = ", ".join(f"{k}={v}" for k, v in result.params.items())
    text = (f"== {result.workload} with KV tiers ({params}; seed {result.seed}; working set "
            f"{result.working_set_pages} pages)\n" + "\n".join(lines))
    r = result.restart
    if r is not None:
        cold, warm = statistics.median(r.cold_ttft_s), statistics.median(r.warm_ttft_s)
        text += (
            f"\nwarm restart, first {r.requests} requests one at a time: TTFT median cold "
            f"{cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms ({cold / warm:.1f}x); cached "
            f"tokens cold {r.cold_cached_tokens}, warm {r.warm_cached_tokens} "
            f"({r.warm_disk_tokens} from disk)"
        )
    return text
