"""``python -m workloads.serve_compare A.json B.json ...``: servers side by side.

Reads ``serve_bench --json`` reports (any number, several servers and workloads, repeated
passes of one server too) and prints one Markdown table per workload: each server's figures
per request rate, medians over the reports of the same server, workload, rate and
concurrency cap. ``--baseline LABEL`` adds the others' output throughput and TTFT p50 as
multiples of it. ``--plot DIR`` draws TTFT p50 and E2E p50 against the rate, one PNG per
workload, every server on the same axes.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

# (workload, concurrency cap, label, rate) -> the median summaries of every report
Key = tuple[str, Any, str, float]


def _rate(value: Any) -> float:
    return float("inf") if value == "inf" else float(value)


def load(paths: Sequence[str | Path]) -> dict[Key, list[dict[str, Any]]]:
    grouped: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        report = msgspec.json.decode(Path(path).read_bytes())
        for rate in report["rates"]:
            key = (
                report["workload"],
                report["max_concurrency"],
                report["label"],
                _rate(rate["rate"]),
            )
            grouped[key].append(rate["median"])
    return grouped


def _median(summaries: list[dict[str, Any]], get: Any) -> float | None:
    values = [get(s) for s in summaries]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


COLUMNS: list[tuple[str, Any, str]] = [
    ("req/s", lambda s: s["request_throughput"], "{:.2f}"),
    ("out tok/s", lambda s: s["output_throughput"], "{:.1f}"),
    ("total tok/s", lambda s: s["total_token_throughput"], "{:.0f}"),
    ("TTFT p50 ms", lambda s: s["ttft"]["p50"] * 1e3, "{:.0f}"),
    ("TTFT p99 ms", lambda s: s["ttft"]["p99"] * 1e3, "{:.0f}"),
    ("ITL p50 ms", lambda s: s["itl"]["p50"] * 1e3, "{:.0f}"),
    ("E2E p50 ms", lambda s: s["e2e"]["p50"] * 1e3, "{:.0f}"),
    ("hit rate", lambda s: None if s["hit_rate"] is None else s["hit_rate"] * 100, "{:.1f}%"),
    ("goodput req/s", lambda s: s["goodput"], "{:.2f}"),
]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def tables(grouped: dict[Key, list[dict[str, Any]]], baseline: str | None) -> str:
    out = []
    for workload, cap in sorted({(k[0], k[1]) for k in grouped}, key=str):
        keys = sorted(
            (k for k in grouped if (k[0], k[1]) == (workload, cap)), key=lambda k: (k[3], k[2])
        )
        title = f"### {workload}" + (f", at most {cap} in flight" if cap else "")
        head = ["rate", "server", "runs", *(c[0] for c in COLUMNS)]
        if baseline:
            head += [f"out tok/s vs {baseline}", f"TTFT p50 vs {baseline}"]
        rows = []
        for k in keys:
            runs = grouped[k]
            row = [_fmt(k[3], "{:g}"), k[2], str(len(runs))]
            row += [_fmt(_median(runs, get), spec) for _, get, spec in COLUMNS]
            if baseline:
                base = grouped.get((k[0], k[1], baseline, k[3]))
                row += _ratios(runs, base)
            rows.append(row)
        lines = [title, "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _ratios(runs: list[dict[str, Any]], base: list[dict[str, Any]] | None) -> list[str]:
    if not base:
        return ["-", "-"]
    out = []
    for get in (lambda s: s["output_throughput"], lambda s: s["ttft"]["p50"]):
        mine, theirs = _median(runs, get), _median(base, get)
        out.append("-" if not mine or not theirs else f"{mine / theirs:.2f}x")
    return out


def plot(grouped: dict[Key, list[dict[str, Any]]], folder: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for workload, cap in sorted({(k[0], k[1]) for k in grouped}, key=str):
        keys = [k for k in grouped if (k[0], k[1]) == (workload, cap)]
        rates = sorted({k[3] for k in keys})
        if len(rates) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label in sorted({k[2] for k in keys}):
            for name, get, style in (
                ("TTFT p50", lambda s: s["ttft"]["p50"], "o-"),
                ("E2E p50", lambda s: s["e2e"]["p50"], "s--"),
            ):
                xs, ys = [], []
                for i, rate in enumerate(rates):
                    runs = grouped.get((workload, cap, label, rate))
                    if runs:
                        xs.append(i)
                        ys.append(_median(runs, get))
                ax.plot(xs, ys, style, label=f"{label} {name}")
        ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (sessions/s; inf = all at once)")
        ax.set_ylabel("seconds")
        ax.set_title(f"{workload}: latency against request rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = folder / f"serve-{workload}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m workloads.serve_compare", description=__doc__)
    p.add_argument("reports", nargs="+", help="serve_bench --json files")
    p.add_argument("--baseline", help="label whose figures the others are divided by")
    p.add_argument("--plot", metavar="DIR", help="write serve-<workload>.png here")
    args = p.parse_args(argv)
    grouped = load(args.reports)
    text = tables(grouped, args.baseline)
    print(text)
    if args.plot:
        for path in plot(grouped, args.plot):
            print(f"wrote {path}")
    return text


if __name__ == "__main__":
    main()
