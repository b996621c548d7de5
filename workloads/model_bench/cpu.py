"""Micro-benchmark: our paged forward against transformers' own forward on the same inputs.

``python -m workloads.model_bench`` prints prefill tokens/s (one request of 128/512/2048
tokens) and decode tokens/s (batch 1/8/32, 512 tokens of context each) for our forward
batch-invariant (``exact``, the default) and not (``fast``), beside transformers' and beside
the case's floor: decode is bounded by reading the weights and the KV once per step at the measured memory
bandwidth, prefill by its FLOPs at the measured matrix-product peak (the faster of torch's
BLAS and our products, with the same threads). Configurations are
interleaved and the median of repeats is quoted, because CPU speed drifts from minute to
minute. ``--beside N`` times every configuration also beside N busy processes (held stopped
between its runs), interleaved with the quiet runs: what a shared machine leaves of the speed.
``--verify-rows 1 3 5 9`` prints instead the milliseconds of one pass by requests x rows
per request x context: what a speculative draft row costs next to the pass it rides in.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine import KVPool, load_hf_reference, load_model
from engine.model.bringup.platforms import platform_for
from engine.model.cpu.malloc_tuning import keep_freed_memory
from engine.model.cpu.products import PackedWeight, load_products
from engine.model.cpu.threads import ThreadPolicy
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request
from workloads.model_bench.neighbours import Neighbours


@dataclass
class Row:
    case: str
    tokens: int
    seconds: dict[str, float]  # median seconds per configuration
    floor_s: float  # the machine's limit for this case

    def tok_s(self, name: str) -> float:
        return self.tokens / self.seconds[name]


class OursCase:
    """Prefill or decode through ModelRunner.forward with a paged pool."""

    def __init__(
        self, loaded: Any, page_size: int, num_tokens: int, exact: bool = True,
        threads: int | None = None,
    ) -> None:
        cfg = loaded.config
        self.ps = page_size
        num_pages = -(-num_tokens // page_size) + 64
        pool = KVPool(
            cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
        )
        platform = platform_for(loaded.device, threads=ThreadPolicy.default(threads))
        self.runner = ModelRunner(loaded, pool, platform, batch_invariant=exact)

    def prefill(self, ids: list[int]) -> Callable[[], None]:
        req = Request(0, ids, SamplingParams(max_new_tokens=1))
        pages = list(range(-(-len(ids) // self.ps)))
        batch = Batch([BatchEntry.on_pages(req, ids, 0, pages, self.ps)], self.ps)

        def run() -> None:
            self.runner.forward(batch)

        return run

    def _filled(
        self, contexts: list[list[int]], extra: int
    ) -> tuple[list[Request], list[list[int]]]:
        """Requests over ``contexts`` with their K/V in the pool (untimed) and page tables with
        room for ``extra`` more tokens each."""
        ps = self.ps
        per_req = -(-(len(contexts[0]) + extra) // ps)
        reqs = [Request(i, c, SamplingParams(max_new_tokens=max(1, extra)))
                for i, c in enumerate(contexts)]
        tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(len(reqs))]
        for r, t in zip(reqs, tables):
            self.runner.forward(Batch([BatchEntry.on_pages(r, r.prompt, 0, t, ps)], ps))
        return reqs, tables

    def decode(self, contexts: list[list[int]], steps: int) -> Callable[[], None]:
        ps = self.ps
        reqs, tables = self._filled(contexts, steps)

        def run() -> None:
            for r in reqs:
                r.output = [0]
            for s in range(steps):
                n = len(reqs[0].prompt) + s
                entries = [BatchEntry.on_pages(r, [7], n, t, ps) for r, t in zip(reqs, tables)]
                self.runner.forward(Batch(entries, ps))

        return run

    def verify(self, contexts: list[list[int]], rows: int) -> Callable[[], None]:
        """One pass in which each request feeds ``rows`` tokens after its context: a decode
        (1 row) or a speculative verify (the last token and ``rows - 1`` drafts)."""
        ps = self.ps
        reqs, tables = self._filled(contexts, rows)
        for r in reqs:
            r.output = [0]
        entries = [BatchEntry.on_pages(r, [7] * rows, len(r.prompt), t, ps)
                   for r, t in zip(reqs, tables)]
        for e in entries:  # every row computes logits, as a verify's rows do
            e.draft = e.input_ids[1:]
        batch = Batch(entries, ps)

        def run() -> None:
            self.runner.forward(batch)

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
    cases: list[tuple[str, int, float, dict[str, Callable[[], None]]]], repeats: int
) -> list[Row]:
    """Interleave the configurations of each case (rotating their order) and repeat; medians."""
    times: dict[str, dict[str, list[float]]] = {
        c: {name: [] for name in fns} for c, _, _, fns in cases
    }
    for _, _, _, fns in cases:  # warm-up
        for fn in fns.values():
            fn()
    for rep in range(repeats):
        for case, _, _, fns in cases:
            names = list(fns)
            names = names[rep % len(names) :] + names[: rep % len(names)]
            for name in names:
                times[case][name].append(_timed(fns[name]))
    return [
        Row(case, n, {k: statistics.median(v) for k, v in times[case].items()}, floor)
        for case, n, floor, _ in cases
    ]


def memory_bandwidth() -> float:
    """Bytes/s torch's threads read from memory (a sum over 512 MB: far past any cache)."""
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def matmul_peak(dtype: torch.dtype) -> float:
    """FLOP/s of a large matrix product with ``dtype`` weights on the current threads: the
    faster of torch's (the vendor BLAS) and ours."""
    a = torch.randn(1024, 576)
    b = torch.randn(576, 3072).to(dtype)
    runs: list[Callable[[], object]] = [lambda: torch.matmul(a.to(dtype), b)]
    kernel = load_products()
    if kernel is not None and dtype in (torch.float32, torch.bfloat16):
        packed = PackedWeight(kernel, b.t().contiguous())
        runs.append(lambda: packed(a, threads=torch.get_num_threads()))
    best = float("inf")
    for run in runs:
        for _ in range(3):
            t = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t)
    return 2 * 1024 * 576 * 3072 / best


def model_bytes(loaded: Any) -> int:
    """Bytes a decode step must read once: every linear weight, the LM head included."""
    total = 0
    for name, p in loaded.model.named_parameters():
        if "embed_tokens" not in name:
            total += p.numel() * p.element_size()
    return total


def kv_bytes(loaded: Any, tokens: int) -> int:
    cfg = loaded.config
    per_token = KVPool.bytes_per_page(
        cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
    )
    return per_token * tokens


def prefill_flops(loaded: Any, n: int) -> float:
    """Linear layers for n tokens (LM head for the last one) plus causal attention."""
    cfg = loaded.config
    linear = 0
    for name, p in loaded.model.named_parameters():
        if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name:
            linear += p.numel()
    head = cfg.vocab_size * cfg.hidden_size
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
    return 2 * linear * n + 2 * head + attention


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m workloads.model_bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default=None, help="an HF checkpoint directory or .gguf file "
                    "(default: the bundled SmolLM2; random ones of every family: "
                    "python -m workloads.checkpoints.families)")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: auto)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill", type=int, nargs="*", default=[128, 512, 2048])
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-transformers", action="store_true", help="skip the reference")
    ap.add_argument("--verify-rows", type=int, nargs="*", default=[], metavar="ROWS",
                    help="instead: ms of one pass where each request of each --decode-batch "
                    "feeds ROWS tokens (a verify of ROWS - 1 drafts), at each --verify-context")
    ap.add_argument("--beside", type=int, default=0, metavar="N",
                    help="also time every configuration beside N busy processes, interleaved "
                    "with its quiet runs (workloads.model_bench.neighbours)")
    ap.add_argument("--verify-context", type=int, nargs="*", default=[128, 512, 1100])
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # malloc as the engine's loop sets it (timings must not hang on history)
    loaded = load_model(args.model, "cpu", args.dtype)
    hf = None if args.no_transformers else load_hf_reference(args.model).to(loaded.dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size

    def rand_ids(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    if args.verify_rows:
        return verify_table(loaded, args, rand_ids)
    bandwidth = memory_bandwidth()
    peak = matmul_peak(loaded.dtype)
    weights = model_bytes(loaded)
    cases: list[tuple[str, int, float, dict[str, Callable[[], None]]]] = []
    need = max([*args.prefill, 1])  # the prefill cases' pools; decode cases size their own
    exact = OursCase(loaded, args.page_size, need, exact=True, threads=args.threads)
    fast = OursCase(loaded, args.page_size, need, exact=False, threads=args.threads)
    steps = args.decode_steps
    with torch.inference_mode():
        for n in args.prefill:
            ids = rand_ids(n)
            fns = {"exact": exact.prefill(ids), "fast": fast.prefill(ids)}
            if not args.no_transformers:
                fns["transformers"] = hf_prefill(hf, ids)
            cases.append((f"prefill {n}", n, prefill_flops(loaded, n) / peak, fns))
        for b in args.decode_batch:
            ctx = [rand_ids(args.context) for _ in range(b)]
            fns = {
                "exact": OursCase(
                    loaded, args.page_size, b * (args.context + steps), threads=args.threads
                ).decode(ctx, steps),
                "fast": OursCase(
                    loaded, args.page_size, b * (args.context + steps), exact=False,
                    threads=args.threads,
                ).decode(ctx, steps),
            }
            if not args.no_transformers:
                fns["transformers"] = hf_decode(hf, ctx, steps)
            step_bytes = weights + kv_bytes(loaded, b * (args.context + steps // 2))
            floor = steps * step_bytes / bandwidth
            cases.append((f"decode b={b} ctx={args.context}", b * steps, floor, fns))
        if args.beside:
            with Neighbours(args.beside) as neighbours:
                for _, _, _, fns in cases:
                    for name in list(fns):
                        fns[f"{name} beside {args.beside}"] = neighbours.beside(fns[name])
                rows = measure(cases, args.repeats)
        else:
            rows = measure(cases, args.repeats)
    print(
        f"model_bench: model={loaded.config.arch} ({loaded.source.name}), dtype={loaded.dtype}, product threads={exact.runner.product_threads}, "
        f"page_size={args.page_size}, exact attention: {exact.runner.backend.kernel_name}, "
        f"products: {loaded.model.products or 'torch'}, "
        f"median of {args.repeats} interleaved repeats; "
        f"measured: memory {bandwidth / 1e9:.1f} GB/s, matmul peak {peak / 1e9:.1f} GFLOP/s"
    )
    names = list(rows[0].seconds)
    header = "".join(f"{n + ' tok/s':>20}" for n in names)
    beside = f"exact beside {args.beside}"
    shared = f"{'beside/quiet':>14}" if args.beside else ""
    print(
        f"{'case':<22}{header}{'floor tok/s':>14}{'exact/floor':>13}{'exact/fast':>12}{shared}"
    )
    for r in rows:
        vals = "".join(f"{r.tok_s(n):>20.1f}" for n in names)
        floor_tok_s = r.tokens / r.floor_s
        ratio = f"{r.tok_s(beside) / r.tok_s('exact'):>13.2f}x" if args.beside else ""
        print(
            f"{r.case:<22}{vals}{floor_tok_s:>14.1f}"
            f"{r.seconds['exact'] / r.floor_s:>12.2f}x{r.tok_s('exact') / r.tok_s('fast'):>12.2f}"
            f"{ratio}"
        )


def verify_table(loaded: Any, args: argparse.Namespace,
                 rand_ids: Callable[[int], list[int]]) -> None:
    """Pass milliseconds by requests x rows per request x context: what a draft row costs
    next to the pass it rides in (the speculation gate fits the same line online)."""
    cases: list[tuple[str, int, float, dict[str, Callable[[], None]]]] = []
    with torch.inference_mode():
        for ctx in args.verify_context:
            for b in args.decode_batch:
                contexts = [rand_ids(ctx) for _ in range(b)]
                case = OursCase(loaded, args.page_size, b * (ctx + max(args.verify_rows)),
                                threads=args.threads)
                for rows in args.verify_rows:
                    cases.append((f"{ctx} {b} {rows}", b * rows, 1.0,
                                  {"exact": case.verify(contexts, rows)}))
        results = measure(cases, args.repeats)
    print(f"model_bench --verify-rows: dtype={loaded.dtype}, page_size={args.page_size}, "
          f"median of {args.repeats} repeats; ms per pass (requests x rows per request)")
    print("| context | requests | " + " | ".join(f"{r} row{'s' * (r > 1)}/request"
                                                 for r in args.verify_rows)
          + " | ms per extra row |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in args.verify_rows) + " | ---: |")
    by_case = {r.case: r.seconds["exact"] * 1e3 for r in results}
    for ctx in args.verify_context:
        for b in args.decode_batch:
            ms = [by_case[f"{ctx} {b} {rows}"] for rows in args.verify_rows]
            lo, hi = min(args.verify_rows), max(args.verify_rows)
            extra = (ms[args.verify_rows.index(hi)] - ms[args.verify_rows.index(lo)]) / (
                b * (hi - lo)) if hi > lo else 0.0
            print(f"| {ctx} | {b} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {extra:.2f} |")


if __name__ == "__main__":
    main()
