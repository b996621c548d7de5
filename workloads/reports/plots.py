"""PNG plots of a bench report: hit rate and throughput per configuration, TTFT distributions.

matplotlib with the Agg backend: no display needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _config_names(report: Any) -> list[str]:
    names: list[str] = []
    for workload in report.workloads:
        for item in workload.configs:
            if item.config.name not in names:
                names.append(item.config.name)
    return names


def _grouped_bars(ax: Any, report: Any, value: Any, names: list[str]) -> None:
    workloads = [w.workload for w in report.workloads]
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs, ys = [], []
        for i, workload in enumerate(report.workloads):
            for item in workload.configs:
                if item.config.name == name:
                    xs.append(i + (k - (len(names) - 1) / 2) * width)
                    ys.append(value(workload, item))
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.legend(fontsize="small")


def plot_hit_rate(report: Any, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = _config_names(report)
    _grouped_bars(ax, report, lambda w, item: item.median.hit_rate * 100, names)
    for i, workload in enumerate(report.workloads):
        ideal = max(item.median.ideal_hit_rate for item in workload.configs) * 100
        ax.hlines(ideal, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                  label="ideal (infinite cache)" if i == 0 else None)
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Hit rate per configuration (median of {report.repeats})")
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_throughput(report: Any, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = _config_names(report)
    _grouped_bars(ax, report, lambda w, item: item.median.total_tps, names)
    for i, workload in enumerate(report.workloads):
        if workload.baseline is not None:
            ax.hlines(workload.baseline.total_tps, i - 0.45, i + 0.45, colors="black",
                      linestyles="dotted",
                      label="transformers generate" if i == 0 else None)
    ax.set_ylabel("prompt + output tokens / s")
    ax.set_title(f"Throughput per configuration (median of {report.repeats})")
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_ttft(workload: Any, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for item in workload.configs:
        if item.ttfts_s:
            ax.ecdf(item.ttfts_s, label=item.config.name)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT distribution: {workload.workload}")
    ax.legend(fontsize="small")
    return _save(fig, path)


def write_plots(report: Any, folder: str | Path) -> list[Path]:
    """Write hit_rate.png, throughput.png and ttft-<workload>.png; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [plot_hit_rate(report, folder / "hit_rate.png"),
             plot_throughput(report, folder / "throughput.png")]
    for workload in report.workloads:
        paths.append(plot_ttft(workload, folder / f"ttft-{workload.workload}.png"))
    return paths
