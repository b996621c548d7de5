"""``python -m workloads.bench``: run workloads through the Engine and report what the cache buys.

Per workload and configuration: requests, prompt tokens, cached tokens, hit rate, the ideal hit
rate (infinite cache, same page size), prefill tokens computed, wall time, input / output
tokens per second, TTFT p50/p99. With ``--compare``, each cache-on configuration is run
interleaved with the cache off (off, on, off, on, ...: the CPU's speed drifts), medians over
``--repeats``, and compared with transformers' ``generate`` one request at a time on a subset.
Every run gets a fresh engine (an empty cache) over one loaded model.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from workloads.baseline import BaselineRequest, load_baseline_model, run_baseline
from workloads.generators import WORKLOADS, generate
from workloads.ideal import PageTrie
from workloads.metrics import RunMetrics, median_metrics, run_metrics
from workloads.runner import RunResult, run_trace
from workloads.text import TextSource
from workloads.tier_bench import (
    TIER_DEFAULTS,
    TIER_WORKLOADS,
    TierWorkloadResult,
    bench_tiers,
    format_tier_table,
)
from workloads.trace import Trace, read_trace, write_trace

# The order --all runs them in: the headline workloads first.
ALL_WORKLOADS = ("shared-prefix", "chat", "rag", "unique", "agent", "fewshot")


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


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def working_set_pages(trace: Trace, tokenizer: Any, page_size: int) -> tuple[int, int]:
    """(distinct whole pages over all first-turn prompts, pages of the longest request)."""
    from workloads.prompts import SessionPrompts

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


def _warm_up(loaded: Any, args: argparse.Namespace) -> None:
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


def _parse_overrides(items: Sequence[str], workloads: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--set users=4`` (every selected workload that has it) or ``--set chat.users=4``."""
    out: dict[str, dict[str, Any]] = {w: {} for w in workloads}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        value: Any = msgspec.json.decode(raw) if raw[:1].isdigit() or raw[:1] in "-[" else raw
        target, dot, name = key.rpartition(".")
        chosen = [target] if dot else [
            w for w in workloads if name in WORKLOADS[w][0].__struct_fields__]
        if not chosen:
            raise ValueError(f"--set: no selected workload has a parameter {name!r}")
        for w in chosen:
            if w not in out:
                raise ValueError(f"--set: workload {w!r} is not selected")
            out[w][name] = value
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workloads.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                       help="workload to run (repeatable)")
    which.add_argument("--all", action="store_true", help="every workload")
    which.add_argument("--trace", type=Path, help="run a trace file (JSONL) instead")
    p.add_argument("--tiers", action="store_true",
                   help="KV tiers under pressure: rag and sessions (or the --workload given) "
                   "with the pool at a tenth of the working set (tiers off, host, host+disk) "
                   "and a warm restart (default 2 repeats)")
    p.add_argument("--policy", action="append", choices=("lpm", "fcfs", "dfs-weight"),
                   help="scheduling policy with the cache on (repeatable; default lpm)")
    p.add_argument("--cache", choices=("on", "off", "both"),
                   help="default: both with --compare, else on")
    p.add_argument("--compare", action="store_true",
                   help="also run the cache off (interleaved) and the transformers baseline")
    p.add_argument("--repeats", type=int, help="runs per configuration (default 3 with "
                   "--compare, else 1); medians are reported")
    p.add_argument("--baseline-requests", type=int, default=4,
                   help="requests of the transformers baseline subset (0: skip it)")
    p.add_argument("--set", action="append", default=[], metavar="[WORKLOAD.]KEY=VALUE",
                   help="workload size, e.g. --set chat.users=4 --set max_new_tokens=16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="HF checkpoint dir or .gguf (default: the bundled model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="default: the engine's choice for the device")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, help="KV pages (default: the engine's budget)")
    p.add_argument("--small-cache-fraction", type=float, default=0.25,
                   help="RAG's small cache: this share of the distinct prompt pages")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write PNG plots into this folder")
    p.add_argument("--save-traces", type=Path, help="write the generated traces (JSONL) here")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads for engine and baseline (0: torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if not (args.workload or args.all or args.trace or args.tiers):
        p.error("one of --workload, --all, --trace or --tiers is required")
    if args.tiers and (args.all or args.trace):
        p.error("--tiers runs rag and sessions, or the --workload given")
    args.policy = args.policy or ["lpm"]
    if args.repeats is None:
        args.repeats = 3 if args.compare else 2 if args.tiers else 1
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.threads < 0:
        p.error("--threads must be >= 0")
    if args.page_size < 1:
        p.error("--page-size must be >= 1")
    if not 0 < args.small_cache_fraction <= 1:
        p.error("--small-cache-fraction must be in (0, 1]")
    return args


def main(argv: Sequence[str] | None = None) -> BenchReport:
    args = parse_args(argv)
    import torch

    from engine.model.loader import load_model

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # The engines take this many threads for prefill (and one for decode steps, see
    # engine.model.threads); transformers' baseline runs with all of them.
    args.torch_threads = torch.get_num_threads()

    loaded = load_model(args.model, args.device, args.dtype)
    tokenizer = loaded.tokenizer
    if args.trace is not None:
        traces = [read_trace(args.trace)]
    else:
        if args.tiers and not args.workload:
            names = list(TIER_WORKLOADS)
        else:
            names = list(ALL_WORKLOADS) if args.all else list(dict.fromkeys(args.workload))
        try:
            overrides = _parse_overrides(args.set, names)
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
        if args.tiers:
            overrides = {n: {**TIER_DEFAULTS.get(n, {}), **overrides[n]} for n in names}
        source = TextSource(tokenizer)
        traces = [generate(n, tokenizer, args.seed, overrides[n], source) for n in names]
    if args.save_traces is not None:
        for trace in traces:
            write_trace(trace, args.save_traces / f"{trace.workload}.jsonl")
    baseline_model = None
    if args.compare and args.baseline_requests > 0:
        baseline_model = load_baseline_model(args.model, loaded.dtype)
    _warm_up(loaded, args)
    report = BenchReport(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine_info(), model=str(loaded.source),
        dtype=str(loaded.dtype).removeprefix("torch."), page_size=args.page_size,
        repeats=args.repeats, workloads=[],
    )
    for trace in traces:
        if args.tiers:
            tiers = bench_tiers(trace, loaded, args)
            report.tiers.append(tiers)
            print(format_tier_table(tiers), flush=True)
        else:
            result = bench_workload(trace.workload, trace, loaded, args, baseline_model)
            report.workloads.append(result)
            print(format_table(result), flush=True)
        print(flush=True)
        if args.json is not None:  # written after every workload: a long run keeps what it got
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
    if args.plot is not None:
        from workloads.plots import write_plots

        for path in write_plots(report, args.plot):
            print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
