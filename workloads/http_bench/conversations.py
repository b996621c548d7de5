"""``python -m workloads.conversation_bench``: conversations that pause between turns, under
memory pressure, through ``/v1/responses`` (``previous_response_id``: the server keeps each
conversation), with the stored turns pinned or not.

Each conversation opens with its own document and a question, then asks short follow-ups,
each after a think time (a user reading, an agent waiting for a tool). Meanwhile filler
traffic (unique prompts, ``/v1/completions``) streams through the KV pool and evicts whatever
is not pinned. Per configuration: the later turns' hit rate (cached / input tokens, as the
server reports them) and their TTFT, against the first turns'.

With ``--start``, the bench starts the server itself for every configuration (interleaved
over ``--repeats``: on off on off ...): ``radixkv serve`` (``engine``) or ``radixkv serve
--replicas 2`` (``replicas``), with ``--response-ttl`` 300 (pins on) or 0 (off); otherwise it
drives ``--url`` as it is.

    python -m workloads.conversation_bench --start engine replicas --repeats 2
    python -m workloads.conversation_bench --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec

from workloads.http_bench.replicas import ReplicaServer

WORDS = (
    "river garden lantern copper meadow harbour violet engine quiet summit marble orchard "
    "falcon timber signal amber canyon velvet pebble thunder willow cobalt saddle prism"
).split()
QUESTIONS = ("Summarise it in one line.", "What is the second point?", "Which number is largest?",
             "Say it more simply.", "What comes last?")


class TurnResult(msgspec.Struct):
    conversation: int
    turn: int
    input_tokens: int
    cached_tokens: int
    ttft_s: float
    ok: bool = True


class ConfigResult(msgspec.Struct):
    setup: str  # engine | replicas
    pins: str  # on | off
    repeat: int
    first_turn_hit: float
    later_turn_hit: float
    first_ttft_p50: float
    later_ttft_p50: float
    later_ttft_p90: float
    failed: int
    fillers: int


def document(rng: random.Random, words: int) -> str:
    """A document of numbered sentences that no other conversation shares."""
    out = []
    for i in range(words // 8):
        picked = " ".join(rng.choice(WORDS) for _ in range(5))
        out.append(f"Point {i + 1}: {picked} {rng.randrange(1000)}.")
    return " ".join(out)


async def stream_turn(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """One streamed ``/v1/responses`` turn: its final response object and its TTFT."""
    started = time.perf_counter()
    ttft = None
    final: dict[str, Any] = {}
    async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event.get("type", "")
            if ttft is None and kind.endswith(".delta"):
                ttft = time.perf_counter() - started
            if kind in ("response.completed", "response.incomplete"):
                final = event["response"]
            elif kind in ("error", "response.failed"):
                raise RuntimeError(f"the turn failed: {event}")
    return final, ttft if ttft is not None else time.perf_counter() - started


async def conversation(
    http: httpx.AsyncClient, index: int, turns: int, think_s: float, doc_words: int,
    max_output_tokens: int, seed: int, salt: str,
) -> list[TurnResult]:
    rng = random.Random(seed * 1000 + index)
    results = []
    previous = None
    for turn in range(turns):
        body: dict[str, Any] = {
            "max_output_tokens": max_output_tokens, "temperature": 0.0, "cache_salt": salt,
            "input": (f"Read this.\n{document(rng, doc_words)}\n{QUESTIONS[0]}" if turn == 0
                      else QUESTIONS[turn % len(QUESTIONS)]),
        }
        if previous is not None:
            body["previous_response_id"] = previous
        try:
            final, ttft = await stream_turn(http, body)
        except (httpx.HTTPError, RuntimeError):
            results.append(TurnResult(index, turn, 0, 0, 0.0, ok=False))
            return results
        usage = final["usage"]
        results.append(TurnResult(
            index, turn, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
            ttft,
        ))
        previous = final["id"]
        if turn + 1 < turns:
            await asyncio.sleep(think_s * rng.uniform(0.8, 1.2))
    return results


async def fillers(http: httpx.AsyncClient, stop: asyncio.Event, words: int, seed: int,
                  salt: str) -> int:
    """Unique prompts, one after another, until ``stop``: how many were sent."""
    rng = random.Random(seed)
    sent = 0
    while not stop.is_set():
        prompt = document(rng, words)
        try:
            await http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 1, "cache_salt": salt,
            })
        except httpx.HTTPError:
            await asyncio.sleep(0.2)
        sent += 1
    return sent


async def run(url: str, args: argparse.Namespace, seed: int) -> tuple[list[TurnResult], int]:
    salt = f"bench-{seed}-{random.getrandbits(32):08x}"  # a run never meets an earlier one
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        stop = asyncio.Event()
        load = [asyncio.ensure_future(fillers(http, stop, args.filler_words, seed * 7 + k, salt))
                for k in range(args.filler_streams)]
        talks = [
            conversation(http, i, args.turns, args.think_time, args.doc_words,
                         args.max_output_tokens, seed, salt)
            for i in range(args.conversations)
        ]
        done = await asyncio.gather(*talks)
        stop.set()
        sent = sum(await asyncio.gather(*load))
    return [turn for talk in done for turn in talk], sent


def summarise(setup: str, pins: str, repeat: int, turns: list[TurnResult],
              fillers_sent: int) -> ConfigResult:
    ok = [t for t in turns if t.ok]
    first = [t for t in ok if t.turn == 0]
    later = [t for t in ok if t.turn > 0]

    def hit(ts: list[TurnResult]) -> float:
        total = sum(t.input_tokens for t in ts)
        return sum(t.cached_tokens for t in ts) / total if total else 0.0

    def quantile(ts: list[TurnResult], q: float) -> float:
        values = sorted(t.ttft_s for t in ts)
        return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")

    return ConfigResult(
        setup, pins, repeat, hit(first), hit(later), quantile(first, 0.5), quantile(later, 0.5),
        quantile(later, 0.9), len(turns) - len(ok), fillers_sent,
    )


def server_args(setup: str, pins: str, args: argparse.Namespace) -> list[str]:
    out = ["--num-pages", str(args.num_pages), "--response-store", ":memory:",
           "--response-ttl", "300" if pins == "on" else "0", "--log-requests", "off"]
    if setup == "replicas":
        out += ["--replicas", "2"]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workloads.conversation_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL")
    where.add_argument("--start", nargs="+", choices=("engine", "replicas"),
                       help="start the server for each configuration (pins on and off)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think-time", type=float, default=3.0, metavar="S")
    p.add_argument("--doc-words", type=int, default=160, help="words of each opening document")
    p.add_argument("--max-output-tokens", type=int, default=12)
    p.add_argument("--filler-streams", type=int, default=2)
    p.add_argument("--filler-words", type=int, default=240)
    p.add_argument("--num-pages", type=int, default=192, help="KV pool of each engine (--start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="folder of the JSON record and the markdown table")
    return p.parse_args(argv)


def table(results: list[ConfigResult]) -> str:
    """Medians over repeats, one row per setup and pins."""
    rows = ["| setup | pins | first-turn hit | later-turn hit | TTFT p50 first | "
            "TTFT p50 later | TTFT p90 later | failed | filler requests |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r.setup, r.pins) for r in results}, key=lambda k: (k[0], k[1] != "on"))
    for setup, pins in keys:
        rs = [r for r in results if (r.setup, r.pins) == (setup, pins)]

        def med(name: str, rs: list[ConfigResult] = rs) -> float:
            return statistics.median(getattr(r, name) for r in rs)

        rows.append(
            f"| {setup} | {pins} | {med('first_turn_hit'):.1%} | {med('later_turn_hit'):.1%} | "
            f"{med('first_ttft_p50') * 1000:.0f} ms | {med('later_ttft_p50') * 1000:.0f} ms | "
            f"{med('later_ttft_p90') * 1000:.0f} ms | {sum(r.failed for r in rs)} | "
            f"{med('fillers'):.0f} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> list[ConfigResult]:
    args = parse_args(argv)
    results: list[ConfigResult] = []
    if args.url:
        turns, sent = asyncio.run(run(args.url, args, args.seed))
        results.append(summarise("given", "as served", 0, turns, sent))
    else:
        for repeat in range(args.repeats):
            for setup in args.start:
                for pins in ("on", "off"):
                    server = ReplicaServer(server_args(setup, pins, args))
                    try:
                        turns, sent = asyncio.run(run(server.url, args, args.seed + repeat))
                    finally:
                        server.stop()
                    result = summarise(setup, pins, repeat, turns, sent)
                    print(msgspec.json.encode(result).decode(), file=sys.stderr, flush=True)
                    results.append(result)
    text = table(results)
    print(text)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"date": stamp, "argv": list(argv or sys.argv[1:]), "params": vars(args),
              "results": results, "table": text}
    (args.out / f"conversation-bench-{stamp}.json").write_bytes(
        msgspec.json.encode(record, enc_hook=str)
    )
    return results
