"""The GPU measurements of the FlashInfer path, printed as Markdown tables for the record.

``python -m workloads.model_bench.gpu --model DIR [--exactness-model DIR]`` on a CUDA machine,
sections in this order (most wanted first: a call cut by its time limit keeps what ran; a
section that fails prints why and the rest still run):

- **exactness**: greedy answers with the cache on vs off, alone vs batched, prefill chunked vs
  whole, and whether a prompt's logits are bit-identical alone and inside a batch, with the
  engine's defaults (deterministic plan, checked at start; decode graphs) and with
  ``batch_invariant=False`` (the fastest plan);
- **decode steps and prefill** of the whole model (``--model``) against their floors (weights
  and KV read once per step; prefill FLOPs at the measured bf16 matrix-product peak), eager
  and in graphs, default and deterministic plans, and on one shared prefix (the cascade: off,
  by its rule, forced);
- **shared-prefix workload**, cache on vs off (8 groups x 8 requests on 1,000- and
  4,000-token prefixes);
- **where a decode step goes**: wall time against the GPU's busy time, kernel launches and
  copies, eager and in graphs, from one profiled step;
- **decode attention** (one layer, FlashInfer's decode kernel) against its floor: the KV bytes
  it must read at the measured HBM bandwidth (a device-to-device copy's).

Speed is reported, never asserted; timings are CUDA-event medians after warm-up.
``--smoke`` runs every section's code at tiny sizes on whatever device the model is on (the
CPU: FlashInfer's torch reference), which is how CI keeps this file from breaking where only a
scarce GPU call would find out.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import torch

from engine import KVPool, load_model
from engine.model.bringup.platforms import platform_for
from engine.model.cuda.flashinfer_backend import FlashInferBackend, flashinfer_ops, reference_ops
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request

Shape = tuple[int, int]  # (batch, context) or (requests, tokens)


class Sizes(msgspec.Struct, frozen=True):
    """What each section measures. The defaults are the record's (a GPU); ``SMOKE`` runs the
    same code in seconds on a CPU."""

    repeats: int = 10
    warmup: int = 3
    copy_bytes: int = 2 << 30
    matmul_n: int = 8192
    attention_heads: tuple[tuple[int, int, int], ...] = ((9, 3, 64), (32, 8, 64))
    attention_shapes: tuple[Shape, ...] = ((1, 2048), (8, 2048), (32, 2048), (128, 2048),
                                           (32, 8192))
    decode_shapes: tuple[Shape, ...] = ((1, 512), (8, 512), (32, 512), (64, 2048))
    cascade_shapes: tuple[Shape, ...] = ((8, 1024), (32, 1024), (64, 4096))
    prefills: tuple[int, ...] = (512, 2048, 8192)
    profile_shapes: tuple[Shape, ...] = ((8, 512), (64, 2048))
    verify_shapes: tuple[Shape, ...] = ((1, 512), (8, 512), (32, 512))
    drafts: tuple[int, ...] = (4, 8)
    prefixes: tuple[int, ...] = (1000, 4000)
    groups: int = 8  # shared-prefix workload: groups x groups requests
    question_tokens: int = 60
    new_tokens: int = 32
    exact_shared: int = 400  # exactness: prompts on one shared prefix, then prompts of their own
    exact_on_shared: int = 12
    exact_own: int = 4
    exact_chunk: int = 128


SMOKE = Sizes(
    repeats=1, warmup=1, copy_bytes=1 << 20, matmul_n=64, attention_heads=((4, 2, 32),),
    attention_shapes=((2, 40),), decode_shapes=((1, 20), (3, 40)), cascade_shapes=((4, 64),),
    prefills=(48,), profile_shapes=((3, 40),),
    verify_shapes=((1, 20), (3, 40)), drafts=(2,), prefixes=(48,), groups=2, question_tokens=6,
    new_tokens=3, exact_shared=40, exact_on_shared=3, exact_own=2, exact_chunk=16,
)


def device_time(fn: Callable[[], object], sizes: Sizes, device: torch.device) -> float:
    """Median seconds of ``fn``: by CUDA events on a GPU, the wall clock elsewhere."""
    for _ in range(sizes.warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(sizes.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    times = []
    for _ in range(sizes.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def hbm_bandwidth(sizes: Sizes, device: torch.device) -> float:
    """Bytes/s moved (read + write) by a device-to-device copy (4 GiB in all on a GPU)."""
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / device_time(lambda: dst.copy_(src), sizes, device)


def matmul_peak(sizes: Sizes, device: torch.device) -> float:
    n = sizes.matmul_n
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / device_time(lambda: a @ a, sizes, device)


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


def attention_rows(bandwidth: float, sizes: Sizes, device: torch.device) -> list[list[object]]:
    """One layer of decode attention (SmolLM2's heads and a 1B Llama's) against KV bytes / BW."""
    rows: list[list[object]] = []
    ps = 16
    ops = flashinfer_ops() if device.type == "cuda" else reference_ops()
    for hq, hkv, d in sizes.attention_heads:
        for b, ctx in sizes.attention_shapes:
            pages = b * -(-ctx // ps) + 1
            pool = KVPool(1, pages, ps, hkv, d, torch.bfloat16, device)
            batch = decode_batch([ctx] * b, ps)
            fb = ForwardBatch.from_batch(batch, device)
            backend = FlashInferBackend(hq, hkv, d, device, ops, torch.bfloat16)
            backend.plan(fb)
            q = torch.randn(b, hq, d, device=device, dtype=torch.bfloat16)
            k = torch.randn(b, hkv, d, device=device, dtype=torch.bfloat16)
            seconds = device_time(partial(backend.run, 0, q, k, k, pool), sizes, device)
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


def flashinfer_runner(loaded: Any, pool: KVPool, **options: Any) -> ModelRunner:
    """A runner on the flashinfer backend (its torch reference on a CPU)."""
    platform = platform_for(loaded.device, "flashinfer")
    return ModelRunner(loaded, pool, platform, backend="flashinfer", **options)


def decode_runner(loaded: Any, pages: int, invariant: bool, graphs: bool, max_batch: int,
                  max_verify_rows: int = 0) -> Any:
    cfg = loaded.config
    pool = KVPool(cfg.num_layers, pages, 16, cfg.num_kv_heads, cfg.head_dim, loaded.dtype,
                  loaded.device, scratch_pages=1)
    return flashinfer_runner(loaded, pool, batch_invariant=invariant, cuda_graphs=graphs,
                             max_batch=max_batch, max_verify_rows=max_verify_rows)


def verify_batch(b: int, ctx: int, drafts: int, page_size: int) -> Batch:
    """``b`` verify entries: each request's last token and ``drafts`` draft tokens after
    ``ctx - 1`` cached ones, every row sampled, each on its own pages."""
    entries, page = [], 0
    for i in range(b):
        need = -(-(ctx + drafts) // page_size)
        draft = [8 + j for j in range(drafts)]
        req = Request(i, [7] * ctx, SamplingParams(max_new_tokens=drafts + 2), output=[7])
        entry = BatchEntry.on_pages(req, [7] + draft, ctx - 1, list(range(page, page + need)),
                                    page_size)
        entry.draft = draft
        entries.append(entry)
        page += need
    return Batch(entries, page_size)


def verify_rows(loaded: Any, sizes: Sizes) -> list[list[object]]:
    """What a verify pass (speculation: the last token and a draft, every row sampled) costs
    against a plain decode step of the same requests, deterministic plan, in graphs and
    eagerly: on a GPU a draft row should be nearly free, which is what speculation buys."""
    rows: list[list[object]] = []
    ps = 16
    time_of = partial(device_time, sizes=sizes, device=loaded.device)
    for b, ctx in sizes.verify_shapes:
        most = max(sizes.drafts)
        pages = b * -(-(ctx + most + 1) // ps) + 2 * b + 8
        for graphs in (True, False):
            mode = "graphs" if graphs else "eager"
            try:
                runner = decode_runner(loaded, pages, True, graphs, b + 1, (b + 1) * (1 + most))
                decode = time_of(partial(runner.step, decode_batch([ctx] * b, ps)))
                for k in sizes.drafts:
                    batch = verify_batch(b, ctx, k, ps)
                    replays = runner.graphs.replays if runner.graphs is not None else 0
                    seconds = time_of(partial(runner.step, batch))
                    ran = (runner.graphs is not None and runner.graphs.replays > replays
                           and not runner.graphs.retired)
                    label = f"verify, {mode}, deterministic" + (
                        " (ran eager)" if graphs and not ran else "")
                    rows.append([label, b, ctx, k, f"{decode * 1e3:.2f}", f"{seconds * 1e3:.2f}",
                                 f"{seconds / decode:.2f}x"])
            except Exception as exc:  # one failed shape must not cost the others their rows
                rows.append([f"verify, {mode}", b, ctx, "", f"failed: {exc!r}"[:120], "", ""])
            finally:
                runner = None
    return rows


def model_rows(loaded: Any, bandwidth: float, peak: float, sizes: Sizes) -> list[list[object]]:
    """Decode steps (forward and sampling) eager and in graphs, own pages and all on one
    shared prefix (the cascade's case: off, by the rule, forced), and prefill."""
    cfg = loaded.config
    weights = weight_bytes(loaded)
    ps = 16
    kv_token = KVPool.bytes_per_page(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim,
                                     loaded.dtype)
    rows: list[list[object]] = []
    time_of = partial(device_time, sizes=sizes, device=loaded.device)
    for name, invariant, graphs in DECODE_MODES:
        for b, ctx in sizes.decode_shapes:
            label = f"decode, own pages, {name}"
            try:
                pages = b * -(-(ctx + 1) // ps) + 8
                runner = decode_runner(loaded, pages, invariant, graphs, max(b, 8))
                if graphs and runner.graphs is None:
                    label += " (capture failed: ran eager)"
                batch = decode_batch([ctx] * b, ps)
                step = time_of(partial(runner.step, batch))
                if graphs and runner.graphs is not None and runner.graphs.retired:
                    label += " (retired, differed from eager: ran eager)"
            except Exception as exc:  # one failed mode must not cost the others their rows
                rows.append([label, b, ctx, f"failed: {exc!r}"[:120], "", "", ""])
                continue
            finally:
                runner = None
            floor = (weights + kv_token * b * ctx) / bandwidth
            rows.append([label, b, ctx, f"{step * 1e3:.2f}",
                         f"{b / step:.0f}", f"{floor * 1e3:.3f}", f"{step / floor:.2f}x"])
    for cascade in ("off", "rule", "forced"):
        for b, ctx in sizes.cascade_shapes:
            label = f"decode, one shared prefix, eager, cascade {cascade}"
            try:
                pages = -(-(ctx + 1) // ps) + b + 8
                runner = decode_runner(loaded, pages, False, False, b)
                backend = runner.backend
                if cascade == "off":
                    backend.cascade = False
                elif cascade == "forced":
                    backend._pays = None
                batch = shared_decode_batch(b, ctx, ps)
                step = time_of(partial(runner.step, batch))
                plan = backend._plan
            except Exception as exc:  # as above: the other rows (and the table) still count
                rows.append([label, b, ctx, f"failed: {exc!r}"[:120], "", "", ""])
                continue
            finally:
                runner = backend = None
            used = "yes" if plan is not None and plan.shared is not None else "no"
            floor = (weights + kv_token * (ctx + b * ps)) / bandwidth
            rows.append([f"{label} ({used})", b, ctx,
                         f"{step * 1e3:.2f}", f"{b / step:.0f}", f"{floor * 1e3:.3f}",
                         f"{step / floor:.2f}x"])
    head = loaded.model.lm_head.weight_t
    params = (weights - head.numel() * head.element_size()) / head.element_size()
    for n in sizes.prefills:
        try:
            pool = KVPool(cfg.num_layers, -(-n // ps) + 8, ps, cfg.num_kv_heads, cfg.head_dim,
                          loaded.dtype, loaded.device)
            runner = flashinfer_runner(loaded, pool, batch_invariant=True)
            req = Request(0, [7] * n, SamplingParams(max_new_tokens=1))
            pages = list(range(-(-n // ps)))
            batch = Batch([BatchEntry.on_pages(req, [7] * n, 0, pages, ps)], ps)
            seconds = device_time(
                partial(runner.forward, batch),
                msgspec.structs.replace(sizes, repeats=max(1, sizes.repeats // 2)), loaded.device,
            )
        except Exception as exc:  # as above
            rows.append(["prefill, deterministic", 1, n, f"failed: {exc!r}"[:120], "", "", ""])
            continue
        finally:
            runner = pool = None
        flops = 2 * params * n + 2 * head.numel() + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
        floor = flops / peak
        rows.append(["prefill, deterministic", 1, n, f"{seconds * 1e3:.2f}", f"{n / seconds:.0f}",
                     f"{floor * 1e3:.3f}", f"{seconds / floor:.2f}x"])
    return rows


def profile_rows(loaded: Any, sizes: Sizes) -> list[list[object]]:
    """Where a decode step's time goes, eager and in graphs (deterministic plan): one step
    under torch's profiler gives the GPU's busy time, the kernels launched from the host
    (a graph replay counts as one launch) and the copies; the step's wall time is measured
    apart (the profiler slows the host). Wall well above GPU time: still host-bound."""
    from torch.profiler import ProfilerActivity, profile

    launch_calls = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                    "cuLaunchKernelEx", "cudaGraphLaunch")
    rows: list[list[object]] = []
    cuda = loaded.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for graphs in (False, True):
        for b, ctx in sizes.profile_shapes:
            pages = b * -(-(ctx + 1) // 16) + 8
            runner = decode_runner(loaded, pages, True, graphs, max(b, 8))
            batch = decode_batch([ctx] * b, 16)
            wall = device_time(partial(runner.step, batch), sizes, loaded.device)
            if cuda:
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                runner.step(batch)
                if cuda:
                    torch.cuda.synchronize()
            events = prof.key_averages()
            busy_us = sum(
                getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                for e in events
            )
            launches = sum(e.count for e in events if e.key in launch_calls)
            copies = sum(e.count for e in events if "memcpy" in e.key.lower())
            mode = "eager" if not graphs else "graphs" if runner.graphs else "graphs (failed: eager)"
            rows.append([
                mode, b, ctx, f"{wall * 1e3:.2f}",
                f"{busy_us / 1e3:.2f}", f"{wall * 1e6 / busy_us:.1f}x" if busy_us else "n/a", launches,
                copies,
            ])
            del runner
    return rows


def shared_prefix_rows(loaded: Any, prefix: int, sizes: Sizes) -> list[list[object]]:
    """8 groups x 8 requests, ``prefix`` tokens each, 60-token questions, 32 tokens out, with
    the engine's default settings on CUDA (deterministic plan, decode graphs)."""
    from engine import Engine

    ids = random_ids(0, loaded.config.vocab_size)
    g = sizes.groups
    prompts = [p + ids(sizes.question_tokens) for p in (ids(prefix) for _ in range(g))
               for _ in range(g)]
    params = SamplingParams(max_new_tokens=sizes.new_tokens, temperature=0.0, ignore_eos=True)
    rows: list[list[object]] = []
    results: dict[bool, list[tuple[float, float]]] = {}
    extra = sizes.question_tokens + sizes.new_tokens + 16
    pages = g * g * -(-(prefix + extra) // 16) + 64
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
        rows.append([prefix, "on" if cache else "off", f"{s:.2f}",
                     f"{len(prompts) * sizes.new_tokens / s:.0f}",
                     f"{runs[-1][1]:.1%}"])
    speedup = statistics.median(r[0] for r in results[False]) / statistics.median(
        r[0] for r in results[True])
    rows.append([prefix, "on vs off", f"{speedup:.2f}x faster", "", ""])
    return rows


def exactness_rows(loaded: Any, sizes: Sizes) -> list[list[object]]:
    """Greedy answers cache on vs off, alone vs batched, prefill chunked vs whole, with the
    engine's defaults (deterministic plan, decode graphs) and with the fastest settings;
    logits alone vs batched."""
    from engine import Engine

    ids = random_ids(1, loaded.config.vocab_size)

    shared = ids(sizes.exact_shared)
    prompts = [shared + ids(10 + 7 * i) for i in range(sizes.exact_on_shared)]
    prompts += [ids(50 + 30 * i) for i in range(sizes.exact_own)]
    params = SamplingParams(max_new_tokens=sizes.new_tokens, temperature=0.0, ignore_eos=True)
    rows: list[list[object]] = []
    for label, knobs in (
        ("defaults", {}),
        ("batch_invariant=False", {"batch_invariant": False}),
    ):
        answers = {}
        state: dict[str, str] = {}
        verified = None
        for name, cache, together, chunk in (
            ("cache on, batched", True, True, None),
            ("cache off, batched", False, True, None),
            (f"cache off, batched, prefill chunks of {sizes.exact_chunk}", False, True,
             sizes.exact_chunk),
            ("cache off, alone", False, False, None),
        ):
            # every running request must decode in one step: at most ``chunk`` of them
            extra = {"max_batch_tokens": chunk, "max_running": min(chunk, 64)} if chunk else {}
            with Engine(model=loaded, backend="flashinfer", prefix_cache=cache,
                        num_pages=8192, **knobs, **extra) as engine:
                verified = engine.batch_invariant
                if together:
                    engine.generate(prompts[:1], params)
                    outs = engine.generate(prompts, params)
                else:
                    outs = [engine.generate([p], params)[0] for p in prompts]
                answers[name] = [o.token_ids for o in outs]
                graphs = engine._loop._runner.graphs  # the engine's own runner
                if graphs is None:
                    state[name] = "off"
                else:
                    retired = ", ".join(f"{b}x{r}" for b, r in sorted(graphs.retired))
                    state[name] = f"{graphs.replays} replays" + (
                        f", retired {retired}" if retired else "")
        base = answers["cache off, alone"]
        for name in answers:
            if name == "cache off, alone":
                continue
            same = sum(a == b for a, b in zip(answers[name], base))
            rows.append([f"{label} (verified invariant: {verified}; graphs: {state[name]})",
                         f"{name} vs alone",
                         f"{same}/{len(prompts)}"])
        rows.append([label, f"logits alone vs in a batch of {len(prompts)}",
                     logits_identical(loaded, prompts, not knobs)])
    return rows


def logits_identical(loaded: Any, prompts: list[list[int]], invariant: bool) -> str:
    """Each prompt's last-token logits from a pass of its own vs from one pass of all."""
    cfg = loaded.config
    ps = 16
    need = sum(-(-len(p) // ps) for p in prompts) + 8
    pool = KVPool(cfg.num_layers, need, ps, cfg.num_kv_heads, cfg.head_dim, loaded.dtype,
                  loaded.device)
    runner = flashinfer_runner(loaded, pool, batch_invariant=invariant)
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


def section(title: str, header: list[str], rows: Callable[[], list[list[object]]]) -> None:
    """Prints one section's table; a failure is printed in its place (with the last line of
    its traceback) and the run goes on: one broken section must not cost the record the rest
    of a scarce device call."""
    print(f"### {title}\n", flush=True)
    start = time.perf_counter()
    try:
        found = rows()
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"(failed after {time.perf_counter() - start:.0f} s: {exc!r} at "
              f"{where.filename}:{where.lineno})\n", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return
    print(table(header, found) + "\n", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)\n", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint for speed (default: bundled)")
    ap.add_argument("--exactness-model", default=None, help="checkpoint for exactness")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="exactness model verify workload profile attention")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, on the CPU unless CUDA is here: checks the code, not speed")
    args = ap.parse_args(argv)
    sizes = SMOKE if args.smoke else Sizes()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        import flashinfer

        name, kernels = torch.cuda.get_device_properties(0).name, f"flashinfer {flashinfer.__version__}"
    else:
        name, kernels = "CPU", "FlashInfer's torch reference"
    bandwidth, peak = hbm_bandwidth(sizes, device), matmul_peak(sizes, device)
    print(f"device: {name}, torch {torch.__version__}, {kernels}; "
          f"measured memory {bandwidth / 1e12:.2f} TB/s (copy, read + write), "
          f"bf16 matmul {peak / 1e12:.0f} TFLOP/s\n")
    # Most wanted first: a call cut by its time limit keeps what ran (each table is flushed).
    if "exactness" not in args.skip:
        exact_model = load_model(args.exactness_model, device, "bfloat16")
        n = sizes.exact_on_shared + sizes.exact_own
        section(f"Exactness (greedy, {n} prompts, {sizes.new_tokens} tokens each)",
                ["settings", "compared", "same"],
                partial(exactness_rows, exact_model, sizes))
        del exact_model
    speed = load_model(args.model, device, "bfloat16")
    if "model" not in args.skip:
        section(f"Whole model ({args.model or 'bundled'}), bf16, page 16",
                ["case", "batch", "context", "ms/step", "tok/s", "floor ms", "x floor"],
                partial(model_rows, speed, bandwidth, peak, sizes))
    if "verify" not in args.skip:
        section("Verify passes (speculation) against a decode step, bf16, page 16",
                ["case", "batch", "context", "drafts", "decode ms", "verify ms",
                 "verify / decode"], partial(verify_rows, speed, sizes))
    if "workload" not in args.skip:
        for prefix in sizes.prefixes:
            section(f"Shared-prefix workload ({prefix}-token prefixes: {sizes.groups ** 2} "
                    f"requests on {sizes.groups} of them, {sizes.new_tokens} tokens out, defaults)",
                    ["prefix", "cache", "seconds", "output tok/s", "hit rate"],
                    partial(shared_prefix_rows, speed, prefix, sizes))
    if "profile" not in args.skip:
        section("Where a decode step goes (deterministic plan, torch profiler, one step)",
                ["mode", "batch", "context", "wall ms", "GPU busy ms", "wall / GPU", "launches",
                 "copies"], partial(profile_rows, speed, sizes))
    if "attention" not in args.skip:
        section("Decode attention, one layer, page size 16",
                ["heads q/kv x dim", "batch", "context", "us", "floor us", "x floor"],
                partial(attention_rows, bandwidth, sizes, device))


if __name__ == "__main__":
    main()
