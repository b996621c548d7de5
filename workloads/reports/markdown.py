"""``python -m workloads.reports.markdown bench-results/bench.json``: a bench report as a Markdown table."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import msgspec

from workloads.engine_bench.records import BenchReport


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def markdown(report: BenchReport) -> str:
    m = report.machine
    lines = [
        f"{report.date}, {m.get('cpu')} ({m.get('cores')} cores, {m.get('torch_threads')} torch "
        f"thread(s)), torch {m.get('torch')}, {Path(report.model).name} in {report.dtype}, "
        f"page size {report.page_size}, medians of {report.repeats} run(s).",
        "",
        "| workload | config | requests | prompt tok | cached tok | hit rate | ideal | prefill "
        "computed | wall s | in tok/s | out tok/s | TTFT p50 s | TTFT p99 s | vs cache off | "
        "vs transformers |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for w in report.workloads:
        for item in w.configs:
            r = item.median
            name = item.config.name + (f" ({item.config.num_pages} pages)"
                                       if item.config.num_pages else "")
            lines.append(
                f"| {w.workload} | {name} | {r.requests} | {r.prompt_tokens} | "
                f"{r.cached_tokens} | {r.hit_rate:.1%} | {r.ideal_hit_rate:.1%} | "
                f"{r.computed_prefill_tokens} | {r.wall_s:.1f} | {r.input_tps:.0f} | "
                f"{r.output_tps:.1f} | {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | "
                f"{_ratio(item.speedup_vs_off)} | {_ratio(item.speedup_vs_baseline)} |"
            )
        if w.baseline is not None:
            b = w.baseline
            lines.append(
                f"| {w.workload} | transformers generate ({b.requests} req) | {b.requests} | "
                f"{b.prompt_tokens} | 0 | | | {b.prompt_tokens} | {b.wall_s:.1f} | "
                f"{b.prompt_tokens / b.wall_s:.0f} | {b.output_tokens / b.wall_s:.1f} | | | | "
                f"1.00x |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m workloads.reports.markdown", description=__doc__)
    p.add_argument("json", type=Path, help="a file written by python -m workloads.bench --json")
    args = p.parse_args(argv)
    report = msgspec.json.decode(args.json.read_bytes(), type=BenchReport)
    text = markdown(report)
    print(text)
    return text


if __name__ == "__main__":
    main()
