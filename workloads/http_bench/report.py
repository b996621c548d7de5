"""What a serving run measured: per-rate summaries, goodput under an SLO, tables and a plot.

Figures follow the common serving-benchmark definitions (vLLM's ``bench serve``, SGLang's
``bench_serving``) so that numbers can be set side by side: throughputs are per second of the
run's duration (first send to last reply), TPOT is (E2E - TTFT) / (output tokens - 1), ITL is
one gap per token after the first, goodput counts the requests meeting every SLO.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from workloads.http_bench.driver import RequestResult, RunRecord
from workloads.reports.stats import percentile

SLO_KEYS = ("ttft", "tpot", "e2e")


class Stats(msgspec.Struct):
    """Mean and percentiles of one latency, in seconds (0 when there are no values)."""

    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0


def stats(values: Sequence[float]) -> Stats:
    if not values:
        return Stats()
    return Stats(
        statistics.fmean(values),
        percentile(values, 50),
        percentile(values, 90),
        percentile(values, 99),
    )


class RateSummary(msgspec.Struct):
    """One run (or the median of its repeats) at one request rate."""

    rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None  # None: the server did not report it
    hit_rate: float | None
    goodput: float | None  # requests meeting every SLO per second; None: no SLO given
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    ids_from: str  # "server", "text" (re-tokenised reply text) or "mixed"
    errors: list[str] = []


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=2,tpot=0.2`` (seconds) into a dict; keys are ttft, tpot and e2e."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo: expected KEY=SECONDS with KEY in {SLO_KEYS}, got {item!r}")
        out[key] = float(value)
        if not out[key] > 0:
            raise ValueError(f"--slo: {key} must be > 0, got {value}")
    return out


def meets_slo(result: RequestResult, slo: dict[str, float]) -> bool:
    """A completed request within every limit of ``slo``."""
    if not result.ok:
        return False
    measured = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2e": result.e2e_s}
    return all(measured[k] is not None and measured[k] <= limit for k, limit in slo.items())


def summarise(run: RunRecord, slo: dict[str, float]) -> RateSummary:
    done = [r for r in run.requests if r.ok]
    failed = [r for r in run.requests if not r.ok]
    duration = run.duration_s
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    known = [r for r in done if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in known) if known else None
    known_prompt = sum(r.prompt_tokens for r in known)
    sources = {r.ids_from for r in done}
    per_s = 1.0 / duration if duration > 0 else 0.0
    return RateSummary(
        rate=run.rate,
        max_concurrency=run.max_concurrency,
        completed=len(done),
        failed=len(failed),
        duration_s=duration,
        request_throughput=len(done) * per_s,
        input_throughput=prompt * per_s,
        output_throughput=output * per_s,
        total_token_throughput=(prompt + output) * per_s,
        prompt_tokens=prompt,
        output_tokens=output,
        cached_tokens=cached,
        hit_rate=cached / known_prompt if cached is not None and known_prompt else None,
        goodput=sum(meets_slo(r, slo) for r in done) * per_s if slo else None,
        ttft=stats([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=stats([t for r in done if (t := r.tpot_s) is not None]),
        itl=stats([g for r in done for g in r.itl_s]),
        e2e=stats([r.e2e_s for r in done if r.e2e_s is not None]),
        ids_from=sources.pop() if len(sources) == 1 else ("mixed" if sources else "server"),
        errors=sorted({r.error for r in failed if r.error})[:5],
    )


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    value = statistics.median(present)
    return round(value) if isinstance(present[0], int) else value


def median_summary(runs: Sequence[RateSummary]) -> RateSummary:
    """Field-wise median over repeats (integers stay integers, None when no run has it)."""
    if not runs:
        raise ValueError("runs must not be empty")
    if len(runs) == 1:
        return runs[0]
    fields: dict[str, Any] = {}
    for name in RateSummary.__struct_fields__:
        values = [getattr(r, name) for r in runs]
        if isinstance(values[0], Stats):
            fields[name] = Stats(
                **{
                    k: statistics.median(getattr(v, k) for v in values)
                    for k in Stats.__struct_fields__
                }
            )
        elif name == "ids_from":
            fields[name] = values[0] if len(set(values)) == 1 else "mixed"
        elif name == "errors":
            fields[name] = sorted({e for v in values for e in v})[:5]
        elif name in ("rate", "max_concurrency"):
            fields[name] = values[0]
        else:
            fields[name] = _median(values)
    return RateSummary(**fields)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def _pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1%}"


def markdown(label: str, summaries: Sequence[RateSummary], slo: dict[str, float]) -> str:
    """Two Markdown tables: throughput per rate, then latency percentiles (milliseconds)."""
    good = "goodput req/s (" + ", ".join(f"{k}<={v:g}s" for k, v in slo.items()) + ")"
    head = [
        "server",
        "rate req/s",
        "max conc",
        "done",
        "failed",
        "duration s",
        "req/s",
        "out tok/s",
        "total tok/s",
        "hit rate",
        good if slo else "goodput",
    ]
    rows = [
        [
            label,
            rate_label(s.rate),
            str(s.max_concurrency or "-"),
            str(s.completed),
            str(s.failed),
            f"{s.duration_s:.2f}",
            f"{s.request_throughput:.3f}",
            f"{s.output_throughput:.1f}",
            f"{s.total_token_throughput:.1f}",
            _pct(s.hit_rate),
            "-" if s.goodput is None else f"{s.goodput:.3f}",
        ]
        for s in summaries
    ]
    lat = ["server", "rate req/s"]
    for name in ("TTFT", "TPOT", "ITL", "E2E"):
        lat += [f"{name} mean", f"{name} p50", f"{name} p90", f"{name} p99"]
    lat_rows = []
    for s in summaries:
        row = [label, rate_label(s.rate)]
        for st in (s.ttft, s.tpot, s.itl, s.e2e):
            row += [_ms(st.mean), _ms(st.p50), _ms(st.p90), _ms(st.p99)]
        lat_rows.append(row)
    return _table(head, rows) + "\n\nLatency (ms):\n\n" + _table(lat, lat_rows)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(head) + " |",
        "| --- | " + " | ".join("---:" for _ in head[1:]) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plot_latency(label: str, summaries: Sequence[RateSummary], folder: str | Path) -> Path:
    """TTFT p50 / p99 and E2E p50 against the request rate, one PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ordered = sorted(summaries, key=lambda s: s.rate)
    xs = list(range(len(ordered)))  # evenly spaced: "inf" has no place on a numeric axis
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, get, style in (
        ("TTFT p50", lambda s: s.ttft.p50, "o-"),
        ("TTFT p99", lambda s: s.ttft.p99, "o--"),
        ("E2E p50", lambda s: s.e2e.p50, "s-"),
    ):
        ax.plot(xs, [get(s) for s in ordered], style, label=name)
    ax.set_xticks(xs, [rate_label(s.rate) for s in ordered])
    ax.set_xlabel("request rate (sessions/s)")
    ax.set_ylabel("seconds")
    ax.set_title(f"{label}: latency against request rate")
    ax.grid(alpha=0.3)
    ax.legend()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label) or "server"
    path = folder / f"serve-latency-{safe}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
