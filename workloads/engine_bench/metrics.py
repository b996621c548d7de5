"""Per-run figures, and their medians over repeats."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import msgspec

from workloads.engine_bench.runner import RunResult
from workloads.reports.stats import percentile
from workloads.traces.ideal import ideal_hit_rate


class RunMetrics(msgspec.Struct):
    """What one run of one configuration measured (throughputs per second of wall time)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ideal_hit_rate: float
    computed_prefill_tokens: int
    output_tokens: int
    wall_s: float
    input_tps: float
    output_tps: float
    total_tps: float
    ttft_p50_s: float
    ttft_p99_s: float
    preemptions: int
    evicted_pages: int
    # Of cached_tokens: loaded back from the KV tiers below the pool (0 without tiers).
    cached_host_tokens: int = 0
    cached_disk_tokens: int = 0


def run_metrics(result: RunResult, page_size: int) -> RunMetrics:
    records = result.records
    prompt = sum(len(r.prompt_ids) for r in records)
    cached = sum(r.cached_tokens for r in records)
    output = sum(len(r.output_ids) for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    wall = result.wall_s
    return RunMetrics(
        requests=len(records),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0,
        ideal_hit_rate=ideal_hit_rate(((r.prompt_ids, r.output_ids) for r in records), page_size),
        computed_prefill_tokens=result.counters.get("computed_prefill_tokens", prompt - cached),
        output_tokens=output,
        wall_s=wall,
        input_tps=prompt / wall,
        output_tps=output / wall,
        total_tps=(prompt + output) / wall,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        preemptions=result.counters.get("preemptions", 0),
        evicted_pages=result.counters.get("evicted_pages", 0),
        cached_host_tokens=result.counters.get("cached_tokens_host", 0),
        cached_disk_tokens=result.counters.get("cached_tokens_disk", 0),
    )


def median_metrics(runs: Sequence[RunMetrics]) -> RunMetrics:
    """Field-wise median over repeats (integers stay integers)."""
    if not runs:
        raise ValueError("runs must not be empty")
    fields = {}
    for name in RunMetrics.__struct_fields__:
        value = statistics.median(getattr(r, name) for r in runs)
        fields[name] = round(value) if isinstance(getattr(runs[0], name), int) else value
    return RunMetrics(**fields)
