"""The engine bench's records: what was run and what it measured, written as JSON
(``--json``) and read back by ``workloads.reports``."""

from __future__ import annotations

from typing import Any

import msgspec

from workloads.engine_bench.metrics import RunMetrics
from workloads.engine_bench.tiers import TierWorkloadResult


class BenchConfig(msgspec.Struct, frozen=True):
    """One engine configuration. ``num_pages`` None: the engine's default KV budget."""

    name: str
    prefix_cache: bool
    policy: str = "lpm"
    num_pages: int | None = None


class ConfigResult(msgspec.Struct):
    config: BenchConfig
    runs: list[RunMetrics]
    median: RunMetrics
    ttfts_s: list[float]  # every request of every repeat
    speedup_vs_off: float | None = None  # median over repeats of throughput(on) / (off)
    speedup_vs_baseline: float | None = None  # median throughput / baseline throughput
    same_outputs_as_off: float | None = None  # share of requests with identical output ids


class BaselineSummary(msgspec.Struct):
    requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    total_tps: float
    dtype: str
    same_outputs_as_engine: float


class WorkloadResult(msgspec.Struct):
    workload: str
    seed: int
    params: dict[str, Any]
    requests: int
    configs: list[ConfigResult]
    baseline: BaselineSummary | None = None


class BenchReport(msgspec.Struct):
    date: str
    machine: dict[str, Any]
    model: str
    dtype: str
    page_size: int
    repeats: int
    workloads: list[WorkloadResult]
    tiers: list[TierWorkloadResult] = []
