"""``radixkv inspect URL``: the inspector's summary in a terminal, for machines without a
browser. It reads the same ``/inspect/state`` as the page: hit rate and where prompt tokens
came from, each engine's pool and tiers, the top prefixes, and the last requests with why
the rest of each prompt was computed."""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from typing import Any

REASONS = {
    "hit": "all cached", "page_boundary": "page boundary", "evicted": "evicted",
    "other_namespace": "other namespace", "never_seen": "never seen",
}


def add_inspect(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "inspect",
        help="print what a running server's KV cache holds (top prefixes, tiers, hit rate)",
    )
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("RADIXKV_API_KEY"),
        help="the server's API key (default: $RADIXKV_API_KEY)",
    )
    parser.add_argument(
        "--cache-salt",
        action="append",
        default=[],
        metavar="SALT",
        help="show the text of this tenant's namespace too (repeatable)",
    )
    parser.add_argument("--budget", type=int, default=400, help="tree nodes to read (default 400)")
    parser.add_argument("--requests", type=int, default=10, help="last requests to list")


def run_inspect(args: argparse.Namespace) -> int:
    import httpx

    base = args.url.rstrip("/").removesuffix("/inspect")
    headers = {}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    if args.cache_salt:
        headers["X-Radixkv-Cache-Salts"] = ",".join(
            base64.urlsafe_b64encode(s.encode("utf-8")).decode("ascii").rstrip("=")
            for s in args.cache_salt
        )
    try:
        response = httpx.get(
            f"{base}/inspect/state", params={"budget": args.budget}, headers=headers, timeout=30
        )
    except httpx.HTTPError as exc:
        print(f"radixkv: error: cannot reach {base}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:200]
        print(f"radixkv: error: {response.status_code}: {message}", file=sys.stderr)
        return 1
    print(summary(response.json(), args.requests))
    return 0


def summary(state: dict[str, Any], requests: int = 10) -> str:
    """The state as plain text (what ``radixkv inspect`` prints)."""
    t = state["totals"]
    lines = [
        f"hit rate {100 * t['hit_rate']:.1f}% over {t['requests']:,} requests: "
        f"{t['prompt_tokens']:,} prompt tokens, {t['pool_tokens']:,} from the pool, "
        f"{t['host_tokens']:,} from host memory, {t['disk_tokens']:,} from disk, "
        f"{t.get('remote_tokens', 0):,} from the shared store, "
        f"{t['computed_tokens']:,} computed; {t['evicted_pages']:,} pages evicted, "
        f"{t['restored_pages']:,} restored",
    ]
    latest = next((b for b in reversed(state["traffic"]) if b["requests"]), None)
    if latest is not None:
        lines.append(
            f"last {_seconds(state)}: TTFT p50 {_ms(latest['ttft_p50'])} p95 "
            f"{_ms(latest['ttft_p95'])}, ITL p50 {_ms(latest['itl_p50'])} p95 "
            f"{_ms(latest['itl_p95'])}, {latest['tokens_per_s']:.1f} tokens/s"
        )
    lines.append("")
    for r in state["replicas"]:
        p, tiers, tree = r["pages"], r["tiers"], r["tree"]
        lines.append(
            f"{r['name']}: pages {p['free']:,} free, {p['cached']:,} cached, {p['private']:,} "
            f"private, {p['pinned']:,} pinned of {p['total']:,}; {r['running']} running, "
            f"{r['waiting']} waiting; tree {tree['shown']:,} of {tree['total_nodes']:,} nodes "
            f"shown (snapshot {r['loop_ms']:.2f} ms on the loop)"
        )
        if tiers["host_budget_bytes"]:
            lines.append(
                f"  host: {tiers['host_pages']:,} pages, {_fill(tiers['host_bytes'], tiers['host_budget_bytes'])}"
            )
        if tiers["disk_budget_bytes"]:
            lines.append(
                f"  disk: {tiers['disk_pages']:,} pages, {_fill(tiers['disk_bytes'], tiers['disk_budget_bytes'])}"
            )
    lines += ["", "top prefixes (tokens under them, namespace, start of text):"]
    for row in state["top_prefixes"]:
        label = row["label"] if row["label"] is not None else "(another tenant's text)"
        where = f" on {row['replica']}" if len(state["replicas"]) > 1 else ""
        lines.append(f"  {row['tokens']:>8,}  {row['namespace']:<18} {label!r}{where}")
    lines += ["", "last requests (cached / prompt tokens, why the rest was computed):"]
    for row in state["routes"][:requests]:
        when = time.strftime("%H:%M:%S", time.localtime(row["at"]))
        label = row["label"] if row["label"] is not None else "(another tenant's text)"
        why = REASONS.get(row["reason"], row["reason"])
        lines.append(
            f"  {when} {row['replica']:<12.12} {row['cached_tokens']:>6,} / "
            f"{row['prompt_tokens']:<6,} {why:<16} {label!r}"
        )
        if row["computed_from"]:
            lines.append(f"{'':>43}computed from {row['computed_from']!r}")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def _fill(used: int, budget: int) -> str:
    return f"{used / 2**20:.1f} of {budget / 2**20:.1f} MiB ({100 * used / budget:.0f}%)"


def _seconds(state: dict[str, Any]) -> str:
    traffic = state["traffic"]
    width = traffic[1]["end"] - traffic[0]["end"] if len(traffic) > 1 else 10
    return f"{width:.0f} s"
