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
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from workloads.engine_bench.baseline import load_baseline_model
from workloads.engine_bench.compare import bench_workload, format_table, warm_up
from workloads.engine_bench.records import BenchReport
from workloads.engine_bench.tiers import (
    TIER_DEFAULTS,
    TIER_WORKLOADS,
    bench_tiers,
    format_tier_table,
)
from workloads.traces.generators import WORKLOADS, generate
from workloads.traces.text import TextSource
from workloads.traces.trace import read_trace, write_trace

# The order --all runs them in: the headline workloads first.
ALL_WORKLOADS = ("shared-prefix", "chat", "rag", "unique", "agent", "fewshot")


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

    from engine import load_model

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # The engines take this many threads for prefill (and one for decode steps, see
    # engine.model.cpu.threads); transformers' baseline runs with all of them.
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
    warm_up(loaded, args)
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
        from workloads.reports.plots import write_plots

        for path in write_plots(report, args.plot):
            print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
