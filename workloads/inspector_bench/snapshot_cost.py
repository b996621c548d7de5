"""What the inspector costs the engine: ``python -m workloads.inspector_bench.snapshot_cost``.

A real Engine (the bundled model) is filled with a tree of about ``--nodes`` nodes by
one-token requests over token-id prompts (groups of branches under a shared header), then,
at idle, the snapshot is timed at several node budgets three ways: on the loop thread
(``InspectSnapshot.loop_s``: the stall, no pass runs meanwhile), the whole ``Engine.inspect``
call as its caller waits, and ``GET /inspect/state`` end to end (labels decoded, JSON) through
the app in this process. Then the loop's stall under traffic: the same snapshot taken twice a
second while requests run, each one's ``loop_s`` against the passes' own times. Writes a JSON
record (``--json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

BUDGETS = (100, 400, 2000, 10_000)
PAGE_SIZE = 4


def machine() -> dict[str, Any]:
    """lscpu's model name and flags (the record says where it was measured)."""
    info: dict[str, Any] = {"platform": platform.platform()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return info
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "Flags"):
            info[key.strip()] = value.strip()
    return info


def prompts(count: int, groups: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts: a shared 8-token header, one of ``groups`` 4-token group prefixes,
    a unique 8-token tail (page size 4: each request adds one node, its tail)."""
    rng = random.Random(seed)
    header = [rng.randrange(100, vocab) for _ in range(8)]
    group_ids = [[rng.randrange(100, vocab) for _ in range(4)] for _ in range(groups)]
    return [
        header + group_ids[i % groups] + [rng.randrange(100, vocab) for _ in range(8)]
        for i in range(count)
    ]


def timed(call: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        out.append(time.perf_counter() - started)
    return out


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_ms": round(1000 * statistics.median(ordered), 3),
        "p90_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "max_ms": round(1000 * ordered[-1], 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m workloads.inspector_bench.snapshot_cost")
    parser.add_argument("--nodes", type=int, default=10_000, help="tree size to build (about)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="write the record here")
    args = parser.parse_args(argv)

    import torch
    from starlette.testclient import TestClient

    from engine import Engine, SamplingParams
    from server import ServerConfig, create_app

    torch.set_num_threads(args.threads)
    requests = args.nodes
    # two unique pages per request (page size 4): about 4 GB of float32 KV at 10k nodes
    engine = Engine(dtype="float32", page_size=PAGE_SIZE, num_pages=requests * 2 + 1024,
                    max_batch_tokens=4096, max_running=256)
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    vocab = engine.tokenizer.vocab_size
    started = time.perf_counter()
    todo = prompts(requests, max(1, requests // 50), vocab)
    for i in range(0, len(todo), 512):
        engine.generate(todo[i : i + 512], one)
    fill_s = time.perf_counter() - started
    total_nodes = engine.inspect(0).tree.total_nodes
    print(f"tree of {total_nodes} nodes in {fill_s:.0f} s", flush=True)

    rows = []
    app = create_app(engine, ServerConfig(inspect_public=True, log_requests=False))
    with TestClient(app) as client:
        for budget in BUDGETS:
            loop = [engine.inspect(budget).loop_s for _ in range(args.repeats)]
            call = timed(lambda b=budget: engine.inspect(b), args.repeats)
            http = timed(
                lambda b=budget: client.get(f"/inspect/state?budget={b}").raise_for_status(),
                max(3, args.repeats // 4),
            )
            shown = len(engine.inspect(budget).tree.nodes)
            body = client.get(f"/inspect/state?budget={budget}").content
            rows.append({"budget": budget, "nodes_shown": shown, "loop": summary(loop),
                         "inspect_call": summary(call), "http_state": summary(http),
                         "state_bytes": len(body)})
            print(rows[-1], flush=True)

    # Under traffic: snapshots at 2 Hz (the page's poll is every 2 s) while requests run.
    stalls: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.5):
            stalls.append(engine.inspect(400).loop_s)

    poller = threading.Thread(target=poll, daemon=True)
    busy = prompts(512, 16, vocab, seed=1)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    steps_before = engine.stats().counters.steps
    started = time.perf_counter()
    poller.start()
    outs = engine.generate(busy, params)
    stop.set()
    poller.join()
    busy_s = time.perf_counter() - started
    steps = engine.stats().counters.steps - steps_before
    engine.close()
    record = {
        "bench": "inspector snapshot cost",
        "machine": machine(),
        "torch_threads": args.threads,
        "tree_nodes": total_nodes,
        "page_size": PAGE_SIZE,
        "fill_s": round(fill_s, 1),
        "at_idle": rows,
        "under_traffic": {
            "requests": len(outs),
            "seconds": round(busy_s, 2),
            "passes": steps,
            "mean_pass_ms": round(1000 * busy_s / max(steps, 1), 2),
            "snapshots": len(stalls),
            "stall_budget_400": summary(stalls) if stalls else None,
        },
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return record


if __name__ == "__main__":
    main()
