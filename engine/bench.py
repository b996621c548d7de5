"""Micro-benchmark: our paged forward against transformers' own forward on the same inputs.

``python -m engine.bench`` prints prefill tokens/s (one request of 128/512/2048 tokens) and
decode tokens/s (batch 1/8/32, 512 tokens of context each), ours beside transformers', as
ratios. Configurations are interleaved and the median of repeats is quoted, because CPU speed
drifts from minute to minute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv_pool import KVPool
from engine.loader import load_hf_reference, load_model
from engine.runner import ModelRunner
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request


@dataclass
class Row:
    case: str
    ours: float  # tokens/s
    theirs: float

    @property
    def ratio(self) -> float:
        return self.ours / self.theirs


def _entry(req: Request, ids: list[int], start: int, pages: list[int], ps: int) -> BatchEntry:
    kv = start + len(ids)
    pages = pages[: -(-kv // ps)]
    slots = [pages[p // ps] * ps + p % ps for p in range(start, kv)]
    return BatchEntry(req, ids, start, pages, slots, True)


class OursCase:
    """Prefill or decode through ModelRunner.forward with a paged pool."""

    def __init__(self, loaded: Any, page_size: int, num_tokens: int) -> None:
        cfg = loaded.config
        self.ps = page_size
        num_pages = -(-num_tokens // page_size) + 64
        pool = KVPool(
            cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
        )
        self.runner = ModelRunner(loaded, pool)

    def prefill(self, ids: list[int]) -> Callable[[], None]:
        req = Request(0, ids, 1)
        batch = Batch([_entry(req, ids, 0, list(range(-(-len(ids) // self.ps))), self.ps)], self.ps)

        def run() -> None:
            self.runner.forward(batch)

        return run

    def decode(self, contexts: list[list[int]], steps: int) -> Callable[[], None]:
        ps = self.ps
        per_req = -(-(len(contexts[0]) + steps) // ps)
        reqs = [Request(i, c, steps) for i, c in enumerate(contexts)]
        tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(len(reqs))]
        for r, t in zip(reqs, tables):  # untimed: fill the pool with each context
            self.runner.forward(Batch([_entry(r, r.prompt, 0, t, ps)], ps))

        def run() -> None:
            for r in reqs:
                r.output = [0]
            for s in range(steps):
                n = len(reqs[0].prompt) + s
                entries = [_entry(r, [7], n, t, ps) for r, t in zip(reqs, tables)]
                self.runner.forward(Batch(entries, ps))

        return run


def hf_prefill(hf: Any, ids: list[int]) -> Callable[[], None]:
    x = torch.tensor([ids])

    def run() -> None:
        hf(x, logits_to_keep=1)

    return run


def hf_decode(hf: Any, contexts: list[list[int]], steps: int) -> Callable[[], None]:
    """transformers' contiguous per-request cache: prefill untimed, then ``steps`` decodes."""
    x = torch.tensor(contexts)

    def run() -> None:
        past = hf(x[:, :-1], use_cache=True, logits_to_keep=1).past_key_values
        step_ids = torch.full((x.shape[0], 1), 7)
        start = time.perf_counter()
        for _ in range(steps):
            past = hf(step_ids, past_key_values=past, use_cache=True).past_key_values
        run.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]

    return run


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return getattr(fn, "elapsed", None) or (time.perf_counter() - start)


def measure(
    pairs: list[tuple[str, int, Callable[[], None], Callable[[], None]]], repeats: int
) -> list[Row]:
    """Interleave ours/theirs per case and repeat; median seconds -> tokens/s."""
    times: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c, *_ in pairs}
    for _, _, ours, theirs in pairs:  # warm-up
        ours()
        theirs()
    for rep in range(repeats):
        for case, _, ours, theirs in pairs:
            first, second = (ours, theirs) if rep % 2 == 0 else (theirs, ours)
            t1, t2 = _timed(first), _timed(second)
            o, h = (t1, t2) if rep % 2 == 0 else (t2, t1)
            times[case][0].append(o)
            times[case][1].append(h)
    return [
        Row(case, n / statistics.median(times[case][0]), n / statistics.median(times[case][1]))
        for case, n, _, _ in pairs
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: auto)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill", type=int, nargs="*", default=[128, 512, 2048])
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(None, "cpu", args.dtype)
    hf = load_hf_reference().to(loaded.dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size

    def rand_ids(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    pairs: list[tuple[str, int, Callable[[], None], Callable[[], None]]] = []
    need = max([*args.prefill, 0]) + max([*args.decode_batch, 0]) * (
        args.context + args.decode_steps
    )
    ours = OursCase(loaded, args.page_size, need)
    with torch.inference_mode():
        for n in args.prefill:
            ids = rand_ids(n)
            pairs.append((f"prefill {n}", n, ours.prefill(ids), hf_prefill(hf, ids)))
        base = OursCase(
            loaded,
            args.page_size,
            max([*args.decode_batch, 1]) * (args.context + args.decode_steps),
        )
        for b in args.decode_batch:
            ctx = [rand_ids(args.context) for _ in range(b)]
            steps = args.decode_steps
            case = (
                OursCase(loaded, args.page_size, b * (args.context + steps))
                if b != max(args.decode_batch)
                else base
            )
            pairs.append(
                (
                    f"decode b={b} ctx={args.context}",
                    b * steps,
                    case.decode(ctx, steps),
                    hf_decode(hf, ctx, steps),
                )
            )
        rows = measure(pairs, args.repeats)
    print(
        f"engine.bench: dtype={loaded.dtype}, threads={torch.get_num_threads()}, "
        f"page_size={args.page_size}, median of {args.repeats} interleaved repeats"
    )
    print(f"{'case':<24}{'ours tok/s':>12}{'transformers tok/s':>20}{'ratio':>8}")
    for r in rows:
        print(f"{r.case:<24}{r.ours:>12.1f}{r.theirs:>20.1f}{r.ratio:>8.2f}")


if __name__ == "__main__":
    main()
