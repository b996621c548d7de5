"""The GPU measurements of the FlashInfer path, printed as Markdown tables for the record.

``python -m workloads.model_bench.gpu --model DIR [--exactness-model DIR]`` on a CUDA machine:

- **decode attention** (one layer, FlashInfer's decode kernel) against its floor: the KV bytes
  it must read at the measured HBM bandwidth (a device-to-device copy's);
- **decode steps and prefill** of the whole model (``--model``) against their floors (weights
  and KV read once per step; prefill FLOPs at the measured bf16 matrix-product peak);
- **shared-prefix workload**, cache on vs off (8 groups x 8 requests on 1,000-token prefixes);
- **where a decode step goes** (last): wall time against the GPU's busy time, kernel launches
  and copies, eager and in graphs, from one profiled step;
- **exactness**: greedy answers with the cache on vs off and alone vs batched, and whether a
  prompt's logits are bit-identical alone and inside a batch, with FlashInfer's default
  settings and its deterministic ones (``batch_invariant=True``: fixed split size, no cascade).

Speed is reported, never asserted; timings are CUDA-event medians after warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from engine import KVPool, load_model
from engine.model.cuda.flashinfer_backend import FlashInferBackend, flashinfer_ops
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request


def cuda_time(fn: Callable[[], object], repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def hbm_bandwidth() -> float:
    """Bytes/s moved (read + write) by a 4 GiB device-to-device copy."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src))


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / cuda_time(lambda: a @ a)


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def decode_batch(lengths: list[int], page_size: int) -> Batch:
    """One decode entry per request, each on its own consecutive pages."""
    entries, page = [], 0
    for i, n in enumerate(lengths):
        need = -(-n // page_size)
        req = Request(i, [7] * n, SamplingParams(max_new_tokens=2), output=[7])
        entries.append(
            BatchEntry.on_pages(req, [7], n - 1, list(range(page, page + need)), page_size)
        )
        page += need
    return Batch(entries, page_size)


def random_ids(seed: int, vocab: int) -> Callable[[int], list[int]]:
    """``ids(n)``: n token ids drawn from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(100, vocab, (n,), generator=gen).tolist()


def attention_rows(bandwidth: float) -> list[list[object]]:
    """One layer of decode attention (SmolLM2's heads and a 1B Llama's) against KV bytes / BW."""
    rows: list[list[object]] = []
    ps = 16
    for hq, hkv, d in ((9, 3, 64), (32, 8, 64)):
        for b, ctx in ((1, 2048), (8, 2048), (32, 2048), (128, 2048), (32, 8192)):
            pages = b * -(-ctx // ps) + 1
            pool = KVPool(1, pages, ps, hkv, d, torch.bfloat16, "cuda")
            batch = decode_batch([ctx] * b, ps)
            fb = ForwardBatch.from_batch(batch, "cuda")
            backend = FlashInferBackend(
                hq, hkv, d, torch.device("cuda"), flashinfer_ops(), torch.bfloat16
            )
            backend.plan(fb)
            q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, hkv, d, device="cuda", dtype=torch.bfloat16)
            seconds = cuda_time(partial(backend.run, 0, q, k, k, pool))
            kv_bytes = 2 * b * ctx * hkv * d * 2
            floor = kv_bytes / bandwidth
            rows.append(
                [f"{hq}/{hkv}x{d}", b, ctx, f"{seconds * 1e6:.1f}", f"{floor * 1e6:.1f}",
                 f"{seconds / floor:.2f}x"]
            )
    return rows


def weight_bytes(loaded: Any) -> int:
    """Bytes of every matrix a decode step reads once (the LM head counted, tied or not)."""
    counted = [p for n, p in loaded.model.named_parameters()
               if p.dim() == 2 and "embed_tokens" not in n]
    total = sum(p.numel() * p.element_size() for p in counted)
    head = loaded.model.lm_head.weight_t
    if not any(head is p for p in counted):  # tied to the embedding: not listed again
        total += head.numel() * head.element_size()
    return total


def shared_decode_batch(b: int, ctx: int, page_size: int) -> Batch:
    """``b`` decodes whose first ``ctx // page_size`` pages are the same (a cached prompt),
    each with a last page of its own."""
    prefix = list(range((ctx - 1) // page_size))
    entries = []
    for i in range(b):
        req = Request(i, [7] * ctx, SamplingParams(max_new_tokens=2), output=[7])
        entries.append(BatchEntry.on_pages(req, [7], ctx - 1, prefix + [len(prefix) + i], page_size))
    return Batch(entries, page_size)


# How each decode row runs: (name, batch_invariant, cuda_graphs). The engine's default on CUDA
# is the last: FlashInfer's deterministic plan, decode replayed from graphs.
DECODE_MODES = (
    ("eager, default plan", False, False),
    ("eager, deterministic", True, False),
    ("graphs, default plan", False, True),
    ("graphs, deterministic", True, True),
)


def decode_runner(loaded: Any, pages: int, invariant: bool, graphs: bool, max_batch: int) -> Any:
    cfg = loaded.config
    pool = KVPool(cfg.num_layers, pages, 16, cfg.num_kv_heads, cfg.head_dim, loaded.dtype,
                  "cuda", scratch_pages=1)
    return ModelRunner(loaded, pool, backend="flashinfer", batch_invariant=invariant,
                       cuda_graphs=graphs, max_batch=max_batch)


def model_rows(loaded: Any, bandwidth: float, peak: float) -> list[list[object]]:
    """Decode steps (forward and sampling) eager and in graphs, own pages and all on one
    shared prefix (the cascade's case: off, by the rule, forced), and prefill."""
    cfg = loaded.config
    weights = weight_bytes(loaded)
    ps = 16
    kv_token = KVPool.bytes_per_page(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim,
                                     loaded.dtype)
    rows: list[list[object]] = []
    shapes = ((1, 512), (8, 512), (32, 512), (64, 2048))
    for name, invariant, graphs in DECODE_MODES:
        for b, ctx in shapes:
            pages = b * -(-(ctx + 1) // ps) + 8
            runner = decode_runner(loaded, pages, invariant, graphs, max(b, 8))
            batch = decode_batch([ctx] * b, ps)
            step = cuda_time(partial(runner.step, batch))
            floor = (weights + kv_token * b * ctx) / bandwidth
            rows.append([f"decode, own pages, {name}", b, ctx, f"{step * 1e3:.2f}",
                         f"{b / step:.0f}", f"{floor * 1e3:.3f}", f"{step / floor:.2f}x"])
            del runner
    for cascade in ("off", "rule", "forced"):
        for b, ctx in ((8, 1024), (32, 1024), (64, 4096)):
            pages = -(-(ctx + 1) // ps) + b + 8
            runner = decode_runner(loaded, pages, False, False, b)
            backend = runner.backend
            if cascade == "off":
                backend.cascade = False
            elif cascade == "forced":
                backend._pays = None
            batch = shared_decode_batch(b, ctx, ps)
            step = cuda_time(partial(runner.step, batch))
            plan = backend._plan
            used = "yes" if plan is not None and plan.shared is not None else "no"
            floor = (weights + kv_token * (ctx + b * ps)) / bandwidth
            rows.append([f"decode, one shared prefix, eager, cascade {cascade} ({used})", b, ctx,
                         f"{step * 1e3:.2f}", f"{b / step:.0f}", f"{floor * 1e3:.3f}",
                         f"{step / floor:.2f}x"])
            del runner
    head = loaded.model.lm_head.weight_t
    params = (weights - head.numel() * head.element_size()) / head.element_size()
    for n in (512, 2048, 8192):
        pool = KVPool(cfg.num_layers, -(-n // ps) + 8, ps, cfg.num_kv_heads, cfg.head_dim,
                      loaded.dtype, "cuda")
        runner = ModelRunner(loaded, pool, backend="flashinfer", batch_invariant=True)
        req = Request(0, [7] * n, SamplingParams(max_new_tokens=1))
        batch = Batch([BatchEntry.on_pages(req, [7] * n, 0, list(range(-(-n // ps))), ps)], ps)
        seconds = cuda_time(partial(runner.forward, batch), repeats=5)
        flops = 2 * params * n + 2 * head.numel() + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
        floor = flops / peak
        rows.append(["prefill, deterministic", 1, n, f"{seconds * 1e3:.2f}", f"{n / seconds:.0f}",
                     f"{floor * 1e3:.3f}", f"{seconds / floor:.2f}x"])
    return rows


def profile_rows(loaded: Any) -> list[list[object]]:
    """Where a decode step's time goes, eager and in graphs (deterministic plan): one step
    under torch's profiler gives the GPU's busy time, the kernels launched from the host
    (a graph replay counts as one launch) and the copies; the step's wall time is measured
    apart (the profiler slows the host). Wall well above GPU time: still host-bound."""
    from torch.profiler import ProfilerActivity, profile

    launch_calls = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                    "cuLaunchKernelEx", "cudaGraphLaunch")
    rows: list[list[object]] = []
    for graphs in (False, True):
        for b, ctx in ((8, 512), (64, 2048)):
            pages = b * -(-(ctx + 1) // 16) + 8
            runner = decode_runner(loaded, pages, True, graphs, max(b, 8))
            batch = decode_batch([ctx] * b, 16)
            wall = cuda_time(partial(runner.step, batch))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner.step(batch)
                torch.cuda.synchronize()
            events = prof.key_averages()
            busy_us = sum(
                getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                for e in events
            )
            launches = sum(e.count for e in events if e.key in launch_calls)
            copies = sum(e.count for e in events if "memcpy" in e.key.lower())
            rows.append([
                "graphs" if graphs else "eager", b, ctx, f"{wall * 1e3:.2f}",
                f"{busy_us / 1e3:.2f}", f"{wall * 1e6 / max(busy_us, 1e-9):.1f}x", launches,
                copies,
            ])
            del runner
    return rows


def shared_prefix_rows(loaded: Any, prefix: int) -> list[list[object]]:
    """8 groups x 8 requests, ``prefix`` tokens each, 60-token questions, 32 tokens out, with
    the engine's default settings on CUDA (deterministic plan, decode graphs)."""
    from engine import Engine

    ids = random_ids(0, loaded.config.vocab_size)

    prompts = [p + ids(60) for p in (ids(prefix) for _ in range(8)) for _ in range(8)]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    rows: list[list[object]] = []
    results: dict[bool, list[tuple[float, float]]] = {}
    pages = 64 * -(-(prefix + 100) // 16) + 64
    for cache in (False, True, False, True):
        with Engine(model=loaded, backend="flashinfer", prefix_cache=cache,
                    num_pages=pages) as engine:
            engine.generate(prompts[:2], params)  # warm-up (kernels, allocator)
            start = time.perf_counter()
            engine.generate(prompts, params, namespace=f"run-{time.time()}")
            seconds = time.perf_counter() - start
            hit = engine.stats().hit_rate
        results.setdefault(cache, []).append((seconds, hit))
    for cache, runs in results.items():
        s = statistics.median(r[0] for r in runs)
        rows.append([prefix, "on" if cache else "off", f"{s:.2f}", f"{64 * 32 / s:.0f}",
                     f"{runs[-1][1]:.1%}"])
    speedup = statistics.median(r[0] for r in results[False]) / statistics.median(
        r[0] for r in results[True])
    rows.append([prefix, "on vs off", f"{speedup:.2f}x faster", "", ""])
    return rows


def exactness_rows(loaded: Any) -> list[list[object]]:
    """Greedy answers cache on vs off, alone vs batched, prefill chunked vs whole, with the
    engine's defaults (deterministic plan, decode graphs) and with the fastest settings;
    logits alone vs batched."""
    from engine import Engine

    ids = random_ids(1, loaded.config.vocab_size)

    shared = ids(400)
    prompts = [shared + ids(10 + 7 * i) for i in range(12)] + [ids(50 + 30 * i) for i in range(4)]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    rows: list[list[object]] = []
    for label, knobs in (
        ("defaults", {}),
        ("batch_invariant=False", {"batch_invariant": False}),
    ):
        answers = {}
        verified = None
        for name, cache, together, chunk in (
            ("cache on, batched", True, True, None),
            ("cache off, batched", False, True, None),
            ("cache off, batched, prefill chunks of 128", False, True, 128),
            ("cache off, alone", False, False, None),
        ):
            extra = {"max_batch_tokens": chunk} if chunk else {}
            with Engine(model=loaded, backend="flashinfer", prefix_cache=cache,
                        num_pages=8192, **knobs, **extra) as engine:
                verified = engine.batch_invariant
                if together:
                    engine.generate(prompts[:1], params)
                    outs = engine.generate(prompts, params)
                else:
                    outs = [engine.generate([p], params)[0] for p in prompts]
                answers[name] = [o.token_ids for o in outs]
        base = answers["cache off, alone"]
        for name in answers:
            if name == "cache off, alone":
                continue
            same = sum(a == b for a, b in zip(answers[name], base))
            rows.append([f"{label} (verified invariant: {verified})", f"{name} vs alone",
                         f"{same}/{len(prompts)}"])
        rows.append([label, "logits alone vs in a batch of 16",
                     logits_identical(loaded, prompts, not knobs)])
    return rows


def logits_identical(loaded: Any, prompts: list[list[int]], invariant: bool) -> str:
    """Each prompt's last-token logits from a pass of its own vs from one pass of all."""
    cfg = loaded.config
    ps = 16
    need = sum(-(-len(p) // ps) for p in prompts) + 8
    pool = KVPool(cfg.num_layers, need, ps, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, "cuda")
    runner = ModelRunner(loaded, pool, backend="flashinfer", batch_invariant=invariant)
    entries, page = [], 0
    for i, p in enumerate(prompts):
        n = -(-len(p) // ps)
        entries.append(BatchEntry.on_pages(
            Request(i, p, SamplingParams(max_new_tokens=1)), p, 0, list(range(page, page + n)), ps
        ))
        page += n
    together = runner.forward(Batch(entries, ps))
    same = sum(
        torch.equal(runner.forward(Batch([e], ps))[0], together[i]) for i, e in enumerate(entries)
    )
    return f"{same}/{len(prompts)} bit-identical"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint for speed (default: bundled)")
    ap.add_argument("--exactness-model", default=None, help="checkpoint for exactness")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="attention model profile workload exactness")
    args = ap.parse_args(argv)
    import flashinfer

    props = torch.cuda.get_device_properties(0)
    bandwidth, peak = hbm_bandwidth(), matmul_peak()
    print(f"device: {props.name}, torch {torch.__version__}, flashinfer {flashinfer.__version__}; "
          f"measured HBM {bandwidth / 1e12:.2f} TB/s (copy, read + write), "
          f"bf16 matmul {peak / 1e12:.0f} TFLOP/s\n")
    if "attention" not in args.skip:
        print("### Decode attention, one layer, page size 16\n")
        print(table(["heads q/kv x dim", "batch", "context", "us", "floor us", "x floor"],
                    attention_rows(bandwidth)) + "\n", flush=True)
    speed = load_model(args.model, "cuda", "bfloat16")
    if "model" not in args.skip:
        print(f"### Whole model ({args.model or 'bundled'}), bf16, page 16\n")
        print(table(["case", "batch", "context", "ms/step", "tok/s", "floor ms", "x floor"],
                    model_rows(speed, bandwidth, peak)) + "\n", flush=True)
    if "workload" not in args.skip:
        print("### Shared-prefix workload (64 requests on 8 prefixes, 32 tokens out, defaults)\n")
        found = [row for prefix in (1000, 4000) for row in shared_prefix_rows(speed, prefix)]
        print(table(["prefix", "cache", "seconds", "output tok/s", "hit rate"], found) + "\n",
              flush=True)
    if "exactness" not in args.skip:
        exact_model = load_model(args.exactness_model, "cuda", "bfloat16")
        print("### Exactness (greedy, 16 prompts, 32 tokens each)\n")
        print(table(["settings", "compared", "same"], exactness_rows(exact_model)) + "\n")
    if "profile" not in args.skip:
        print("### Where a decode step goes (deterministic plan, torch profiler, one step)\n")
        try:
            found = profile_rows(speed)  # last: its cost may not cut the rest
        except Exception as exc:  # a profiler failure must not cost the rest of the record
            print(f"(profile failed: {exc!r})\n", flush=True)
        else:
            print(table(["mode", "batch", "context", "wall ms", "GPU busy ms", "wall / GPU",
                         "launches", "copies"], found) + "\n", flush=True)


if __name__ == "__main__":
    main()
