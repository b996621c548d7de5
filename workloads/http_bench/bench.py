"""``python -m workloads.serve_bench --url http://HOST:PORT``: benchmark any OpenAI-compatible
server (``radixkv serve``, ``vllm serve``) over HTTP with the repo's workloads.

Requests are streamed ``/v1/completions`` with token-id prompts (both servers see the same
tokens); sessions arrive as a Poisson process at each ``--request-rate`` (``inf``: all at once),
optionally under a ``--max-concurrency`` cap; multi-turn sessions are closed loops over the
reply tokens the server returned. Per rate: completed / failed, throughputs, TTFT / TPOT / ITL /
E2E mean and percentiles, goodput under ``--slo``, and the prefix-cache hit rate the server
reports (``usage.prompt_tokens_details.cached_tokens``).

Every run puts a short random token prefix before its prompts (``--isolate prefix``), so a
later rate or repeat does not find the earlier run's prompts in the server's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec

from workloads.http_bench.driver import (
    ISOLATION,
    Client,
    RequestResult,
    RunRecord,
    RunSpec,
    ServerInfo,
    httpx,
    make_http,
    probe,
    run_salt,
    run_trace,
    server_model,
)
from workloads.http_bench.report import (
    RateSummary,
    markdown,
    median_summary,
    parse_slo,
    plot_latency,
    rate_label,
    summarise,
)
from workloads.traces.generators import WORKLOADS, generate
from workloads.traces.tokenizer import load_tokenizer
from workloads.traces.trace import Trace, read_trace


class RateResult(msgspec.Struct):
    rate: float
    median: RateSummary
    runs: list[RateSummary]
    records: list[RunRecord]


class ServeBenchReport(msgspec.Struct):
    """Everything one invocation measured (``--json``): the raw per-request figures included."""

    date: str
    label: str
    server: ServerInfo
    workload: str
    seed: int
    params: dict[str, Any]
    sessions: int
    requests: int
    max_concurrency: int | None
    repeats: int
    isolate: str
    slo: dict[str, float]
    notes: list[str]
    rates: list[RateResult]


def parse_rates(text: str) -> list[float]:
    """``0.5,1,inf`` into floats (inf: all at once); each must be > 0."""
    rates = []
    for item in text.split(","):
        item = item.strip()
        value = math.inf if item.lower() in ("inf", "infinity") else float(item)
        if not value > 0:
            raise ValueError(f"--request-rate: rates must be > 0, got {item!r}")
        rates.append(value)
    if not rates:
        raise ValueError("--request-rate: no rate given")
    return rates


def parse_overrides(items: Sequence[str], workload: str) -> dict[str, Any]:
    """``--set users=4`` or ``--set chat.users=4`` (numbers and lists as JSON)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        target, dot, name = key.rpartition(".")
        if dot and target != workload:
            raise ValueError(f"--set: {key!r} is not a parameter of {workload!r}")
        numeric = raw[:1].isdigit() or raw[:1] in "-[."
        out[name] = msgspec.json.decode(raw) if numeric else raw
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m workloads.serve_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--label", help="the server's name in outputs (default: host:port)")
    p.add_argument("--workload", default="chat", choices=sorted(WORKLOADS))
    p.add_argument("--trace", help="read this trace file (workloads.traces.trace) instead of generating")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[WORKLOAD.]KEY=VALUE",
        help="workload size, e.g. --set users=4 --set max_new_tokens=16",
    )
    p.add_argument("--seed", type=int, default=0, help="trace and arrival seed")
    p.add_argument(
        "--request-rate",
        default="inf",
        metavar="R[,R...]",
        help="sessions per second, Poisson; several comma-separated; inf: all at once",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        metavar="C",
        help="at most C requests in flight (default: no cap)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per rate; medians are reported")
    p.add_argument("--slo", help="goodput limits in seconds, e.g. ttft=2,tpot=0.2 (and e2e)")
    p.add_argument(
        "--isolate",
        choices=ISOLATION,
        default="prefix",
        help="keep runs from hitting each other's cache: a random token prefix per "
        "run (prefix), vLLM's cache_salt field (cache-salt), or nothing (none)",
    )
    p.add_argument(
        "--trace-eos",
        action="store_true",
        help="honour each turn's ignore_eos from the trace (default: always "
        "ignore_eos, so every reply has max_new_tokens tokens)",
    )
    p.add_argument("--tokenizer", help="HF directory or .gguf (default: the bundled model's)")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for a byte of a reply"
    )
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--json", metavar="PATH", help="write every figure, per request too")
    p.add_argument("--plot", metavar="DIR", help="write a latency-against-rate PNG here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    try:
        args.rates = parse_rates(args.request_rate)
        args.slo_limits = parse_slo(args.slo)
        args.overrides = parse_overrides(args.set, args.workload)
    except ValueError as exc:
        p.error(str(exc))
    return args


def notes_for(info: ServerInfo, summaries: Sequence[RateSummary]) -> list[str]:
    """What the reader must know to trust the figures."""
    notes = []
    if not info.returns_token_ids or any(s.ids_from != "server" for s in summaries):
        notes.append(
            "the server returned no token ids (return_token_ids): replies were "
            "re-tokenised from their text, so a multi-turn prompt may differ from the "
            "tokens the server generated"
        )
    if not info.reports_cached_tokens or any(s.hit_rate is None for s in summaries):
        notes.append(
            "the server did not report usage.prompt_tokens_details.cached_tokens: "
            "hit rate unknown (vLLM reports it only with --enable-prompt-tokens-details)"
        )
    return notes


def _progress(total: int, desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="req",
        leave=False,
        disable=quiet,
        file=sys.stderr,
        dynamic_ncols=True,
    )


async def bench(args: argparse.Namespace, trace: Trace, tokenizer: Any) -> ServeBenchReport:
    """Probe the server, then every rate ``args.repeats`` times, in the order given."""
    rng = random.Random()  # salts must differ between invocations against one server
    async with make_http(args.url, args.timeout, args.api_key) as http:
        model = args.model or await server_model(http)
        client = Client(http, model, tokenizer, args.trace_eos)
        returns_ids, reports_cached = await probe(client, tokenizer)
        info = ServerInfo(args.url, model, returns_ids, reports_cached)
        label = args.label or urlparse(args.url).netloc or args.url
        results = []
        for rate in args.rates:
            runs, records = [], []
            for repeat in range(args.repeats):
                salt: tuple[int, ...] = ()
                client.extra = {}
                if args.isolate == "prefix":
                    salt = run_salt(tokenizer, rng)
                elif args.isolate == "cache-salt":
                    client.extra = {"cache_salt": f"serve-bench-{rng.getrandbits(64):016x}"}
                spec = RunSpec(rate, repeat, args.max_concurrency, args.seed, salt)
                desc = f"{label} rate {rate_label(rate)} #{repeat + 1}"
                with _progress(trace.num_requests, desc, args.quiet) as bar:

                    def done(_: RequestResult, bar: Any = bar) -> None:
                        bar.update(1)

                    record = await run_trace(client, trace, spec, done)
                records.append(record)
                runs.append(summarise(record, args.slo_limits))
            results.append(RateResult(rate, median_summary(runs), runs, records))
    summaries = [r.median for r in results]
    return ServeBenchReport(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        label=label,
        server=info,
        workload=trace.workload,
        seed=trace.seed,
        params=trace.params,
        sessions=len(trace.sessions),
        requests=trace.num_requests,
        max_concurrency=args.max_concurrency,
        repeats=args.repeats,
        isolate=args.isolate,
        slo=args.slo_limits,
        notes=notes_for(info, summaries),
        rates=results,
    )


def json_safe(value: Any) -> Any:
    """``inf`` (an unlimited rate) as the string "inf", as vLLM writes it: JSON has no
    infinity, and msgspec would write null."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def format_report(report: ServeBenchReport) -> str:
    params = ", ".join(f"{k}={v}" for k, v in report.params.items())
    head = (
        f"== {report.label}: {report.workload} ({params}; seed {report.seed}), "
        f"{report.sessions} sessions, {report.requests} requests per run, model "
        f"{report.server.model!r}, {report.repeats} run(s) per rate"
        + (" (medians)" if report.repeats > 1 else "")
    )
    lines = [head, ""]
    lines += [f"note: {n}" for n in report.notes]
    if report.notes:
        lines.append("")
    summaries = [r.median for r in report.rates]
    lines.append(markdown(report.label, summaries, report.slo))
    for s in summaries:
        for error in s.errors:
            lines.append(f"error at rate {rate_label(s.rate)}: {error}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> ServeBenchReport:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.trace:
        trace = read_trace(args.trace)
    else:
        trace = generate(args.workload, tokenizer, args.seed, args.overrides)
    try:
        report = asyncio.run(bench(args, trace, tokenizer))
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        raise SystemExit(f"serve_bench: {args.url}: {type(exc).__name__}: {exc}") from exc
    print(format_report(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        encoded = msgspec.json.encode(json_safe(msgspec.to_builtins(report)))
        path.write_bytes(msgspec.json.format(encoded) + b"\n")
        print(f"wrote {path}")
    if args.plot:
        print(f"wrote {plot_latency(report.label, [r.median for r in report.rates], args.plot)}")
    return report


if __name__ == "__main__":
    main()
