"""``python -m workloads.http_bench.shared_store``: two ``radixkv serve`` processes (no Ray),
with and without one shared Redis store (``--kv-remote``), interleaved.

Per round: server A answers a question over a fresh document (computing it); then server B,
which has never seen it, gets its first request over the same document. With the shared
store B loads the document's pages that A wrote; without, B computes it. Reports B's time to
first token and cached tokens, medians over the rounds, with the greedy answers compared.

    python -m workloads.http_bench.shared_store --rounds 3 --doc-tokens 1500
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from workloads import redis_server
from workloads.http_bench.replicas import ReplicaServer

MODEL = "SmolLM2-135M-Instruct"


def ask(url: str, prompt: str) -> dict[str, Any]:
    """One greedy streamed completion: its text, time to first token, cached tokens."""
    started = time.perf_counter()
    first = None
    text, usage = "", {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter() - started
                text += chunk["choices"][0].get("text", "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {"text": text, "ttft_s": first, "cached": details.get("cached_tokens", 0),
            "prompt": usage.get("prompt_tokens", 0)}


def document(tokens: int) -> str:
    """A fresh document of about ``tokens`` tokens (a random tag: nothing cached anywhere)."""
    tag = uuid.uuid4().hex[:8]
    lines = [f"Record {tag}-{i}: shipment {i} of batch {tag} left depot {i % 7} at {i % 24}:00."
             for i in range(tokens // 22 + 1)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for shared in (False, True):
            with contextlib.ExitStack() as stack:
                flags = ["--num-pages", "512", "--response-store", ":memory:"]
                if shared:
                    folder = stack.enter_context(tempfile.TemporaryDirectory())
                    url, _ = stack.enter_context(redis_server.redis_server(Path(folder)))
                    flags += ["--kv-remote", url]
                a, b = (ReplicaServer(flags, module="server.cli") for _ in range(2))
                try:
                    prompt = document(args.doc_tokens) + "\nWhich depot did shipment 3 leave?"
                    seen = ask(a.url, prompt)
                    time.sleep(1.0)  # the shared store's writes are asynchronous
                    first = ask(b.url, prompt)
                    rows.append({"round": round_, "shared": shared, "a_ttft_s": seen["ttft_s"],
                                 "b_ttft_s": first["ttft_s"], "b_cached": first["cached"],
                                 "prompt": first["prompt"], "same": seen["text"] == first["text"]})
                    print(rows[-1], flush=True)
                finally:
                    a.stop()
                    b.stop()
    print()
    print("| shared store | rounds | prompt tokens | B's first request: cached tokens | "
          "B's TTFT s (median) | A's TTFT s (median) | answers equal |")
    print("|---|---|---|---|---|---|---|")
    for shared in (False, True):
        mine = [r for r in rows if r["shared"] is shared]
        print(f"| {'on' if shared else 'off'} | {len(mine)} | {mine[0]['prompt']} | "
              f"{statistics.median(r['b_cached'] for r in mine):.0f} | "
              f"{statistics.median(r['b_ttft_s'] for r in mine):.3f} | "
              f"{statistics.median(r['a_ttft_s'] for r in mine):.3f} | "
              f"{sum(r['same'] for r in mine)}/{len(mine)} |")
    return rows


if __name__ == "__main__":
    main()
