"""One workload through every engine configuration: the cache off and on interleaved (off,
on, off, on, ...: the CPU's speed drifts), a fresh engine (an empty cache) per run over one
loaded model, medians over repeats, and transformers' ``generate`` on a subset as the
baseline; and the console table of the result.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any

from workloads.engine_bench.baseline import BaselineRequest, run_baseline
from workloads.engine_bench.metrics import median_metrics, run_metrics
from workloads.engine_bench.records import (
    BaselineSummary,
    BenchConfig,
    ConfigResult,
    WorkloadResult,
)
from workloads.engine_bench.runner import RunResult, run_trace
from workloads.traces.ideal import PageTrie
from workloads.traces.trace import Trace


def working_set_pages(trace: Trace, tokenizer: Any, page_size: int) -> tuple[int, int]:
    """(distinct whole pages over all first-turn prompts, pages of the longest request)."""
    from workloads.traces.prompts import SessionPrompts

    trie = PageTrie(page_size)
    nodes = 0
    longest = 0
    for session in trace.sessions:
        prompt = SessionPrompts(session, trace, tokenizer).prompt()
        matched = trie.match(prompt)
        nodes += (len(prompt) - matched) // page_size
        trie.insert(prompt)
        longest = max(longest, len(prompt) + max(t.max_new_tokens for t in session.turns))
    return nodes, math.ceil(longest / page_size)


def build_configs(workload: str, trace: Trace, tokenizer: Any, args: argparse.Namespace
                  ) -> list[BenchConfig]:
    """Cache off first (the reference), then cache on per policy; RAG also with a small cache."""
    configs: list[BenchConfig] = []
    cache = args.cache or ("both" if args.compare else "on")
    if cache in ("off", "both"):
        configs.append(BenchConfig("off", False, args.policy[0], args.num_pages))
    if cache in ("on", "both"):
        for policy in args.policy:
            name = "on" if len(args.policy) == 1 else f"on-{policy}"
            configs.append(BenchConfig(name, True, policy, args.num_pages))
        if workload == "rag" and args.num_pages is None:
            pages, longest = working_set_pages(trace, tokenizer, args.page_size)
            small = max(math.ceil(pages * args.small_cache_fraction), 4 * longest)
            for policy in args.policy:
                suffix = "" if len(args.policy) == 1 else f"-{policy}"
                configs.append(BenchConfig(f"on-small{suffix}", True, policy, small))
    return configs


def _progress(total: int, desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, disable=quiet,
                file=sys.stderr, dynamic_ncols=True)


def _run_config(loaded: Any, config: BenchConfig, trace: Trace, args: argparse.Namespace,
                desc: str) -> RunResult:
    from engine import Engine

    engine = Engine(model=loaded, page_size=args.page_size, num_pages=config.num_pages,
                    policy=config.policy, prefix_cache=config.prefix_cache,
                    threads=args.torch_threads)
    try:
        with _progress(trace.num_requests, desc, args.quiet) as bar:
            return run_trace(engine, trace, loaded.tokenizer, on_done=bar.update)
    finally:
        engine.close()


def warm_up(loaded: Any, args: argparse.Namespace) -> None:
    """One small batch on a throwaway engine: first-call costs stay out of the timings."""
    from engine import Engine, SamplingParams

    engine = Engine(model=loaded, page_size=args.page_size, num_pages=256,
                    threads=args.torch_threads)
    try:
        prompts = [[(i * 7919 + j * 104729) % 40000 + 100 for j in range(200 + 10 * i)]
                   for i in range(4)]
        engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    finally:
        engine.close()


def _same_outputs(a: RunResult, b: RunResult) -> float:
    """Share of ``a``'s requests whose output ids equal ``b``'s for the same turn/branch."""
    theirs = {(r.session, r.turn, r.branch): r.output_ids for r in b.records}
    same = sum(1 for r in a.records if theirs.get((r.session, r.turn, r.branch)) == r.output_ids)
    return same / len(a.records) if a.records else 1.0


def _baseline_subset(result: RunResult, trace: Trace, count: int) -> list[BaselineRequest]:
    """``count`` requests spread evenly over the run's send order (later chat turns too)."""
    turns = {s.id: s.turns for s in trace.sessions}
    records = result.records
    count = min(count, len(records))
    picked = [records[(i * len(records)) // count] for i in range(count)]
    out = []
    for r in picked:
        turn = turns[r.session][r.turn]
        out.append(BaselineRequest(r.prompt_ids, turn.max_new_tokens, turn.ignore_eos))
    return out


def bench_workload(workload: str, trace: Trace, loaded: Any, args: argparse.Namespace,
                   baseline_model: Any) -> WorkloadResult:
    configs = build_configs(workload, trace, loaded.tokenizer, args)
    results: dict[str, list[RunResult]] = {c.name: [] for c in configs}
    for repeat in range(args.repeats):
        for config in configs:
            desc = f"{workload} {config.name} {repeat + 1}/{args.repeats}"
            results[config.name].append(_run_config(loaded, config, trace, args, desc))
    out: list[ConfigResult] = []
    off = results.get("off")
    for config in configs:
        runs = results[config.name]
        metrics = [run_metrics(r, args.page_size) for r in runs]
        item = ConfigResult(config, metrics, median_metrics(metrics),
                            [r.ttft_s for run in runs for r in run.records if r.ttft_s is not None])
        if off is not None and config.name != "off":
            off_metrics = [run_metrics(r, args.page_size) for r in off]
            item.speedup_vs_off = statistics.median(
                m.total_tps / o.total_tps for m, o in zip(metrics, off_metrics))
            item.same_outputs_as_off = statistics.median(
                _same_outputs(r, o) for r, o in zip(runs, off))
        out.append(item)
    summary = None
    if baseline_model is not None and args.baseline_requests > 0:
        reference = (off or results[configs[0].name])[0]
        subset = _baseline_subset(reference, trace, args.baseline_requests)
        import torch

        torch.set_num_threads(args.torch_threads)  # the engines' loop changes it per pass
        with _progress(len(subset), f"{workload} transformers", args.quiet) as bar:
            base = run_baseline(baseline_model, subset, loaded.config.eos_token_ids, bar.update)
        by_prompt = {tuple(r.prompt_ids): r.output_ids for r in reference.records}
        same = sum(1 for req, ids in zip(subset, base.output_ids)
                   if by_prompt.get(tuple(req.prompt_ids)) == ids)
        summary = BaselineSummary(base.requests, base.prompt_tokens, base.output_tokens,
                                  base.wall_s, base.total_tps, str(loaded.dtype).removeprefix(
                                      "torch."), same / len(subset))
        for item in out:
            item.speedup_vs_baseline = item.median.total_tps / base.total_tps
    return WorkloadResult(workload, trace.seed, trace.params, trace.num_requests, out, summary)


def _fmt_ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def format_table(result: WorkloadResult) -> str:
    head = ("config", "pages", "req", "prompt", "cached", "hit", "ideal", "computed", "wall s",
            "in tok/s", "out tok/s", "ttft p50", "ttft p99", "vs off", "vs HF", "same out")
    rows = []
    for item in result.configs:
        m = item.median
        rows.append((
            f"{item.config.name} ({item.config.policy})" if item.config.prefix_cache
            else item.config.name,
            str(item.config.num_pages or "default"), str(m.requests), str(m.prompt_tokens),
            str(m.cached_tokens), f"{m.hit_rate:.1%}", f"{m.ideal_hit_rate:.1%}",
            str(m.computed_prefill_tokens), f"{m.wall_s:.1f}", f"{m.input_tps:.0f}",
            f"{m.output_tps:.1f}", f"{m.ttft_p50_s:.2f}", f"{m.ttft_p99_s:.2f}",
            _fmt_ratio(item.speedup_vs_off), _fmt_ratio(item.speedup_vs_baseline),
            "" if item.same_outputs_as_off is None else f"{item.same_outputs_as_off:.0%}",
        ))
    if result.baseline is not None:
        b = result.baseline
        rows.append((f"transformers ({b.dtype})", "-", str(b.requests), str(b.prompt_tokens),
                     "0", "-", "-", str(b.prompt_tokens), f"{b.wall_s:.1f}",
                     f"{b.prompt_tokens / b.wall_s:.0f}", f"{b.output_tokens / b.wall_s:.1f}",
                     "", "", "", "1.00x", f"{b.same_outputs_as_engine:.0%}"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    params = ", ".join(f"{k}={v}" for k, v in result.params.items())
    return f"== {result.workload} ({params}; seed {result.seed})\n" + "\n".join(lines)
