"""What the dtype probe's child process runs: the real model loaded in one dtype, the engine's
forward timed at a decode and a prefill shape, and its batch invariance checked.

It lives apart from ``dtype_probe`` because it needs the whole model side (the load, the
runner, the invariance check) while the load needs the probe's verdict for its "auto" dtype:
the probe only starts this module in a child (a faulting instruction then kills the child
alone) and reads back the ``DtypeReport`` it prints.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from engine.model.bringup import invariance
from engine.model.bringup.dtype_probe import DtypeReport
from engine.model.bringup.load import load_model
from engine.model.cpu.exact_attention import load_kernel
from engine.model.loader import LoadedModel
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request

DECODE_ROWS, DECODE_CONTEXT, PREFILL_TOKENS = 8, 128, 256


def _time_forward(loaded: LoadedModel, threads: int) -> tuple[float, float]:
    """Seconds of one decode step (DECODE_ROWS requests) and one prefill pass."""
    per = -(-max(DECODE_CONTEXT + 1, PREFILL_TOKENS) // 16)
    runner = invariance.runner_for(loaded, 16, threads, 16 * per * (DECODE_ROWS + 1))
    ctx = list(range(2000, 2000 + DECODE_CONTEXT))
    reqs = [Request(i, ctx, SamplingParams(max_new_tokens=8)) for i in range(DECODE_ROWS)]
    tables = [list(range(i * per, (i + 1) * per)) for i in range(DECODE_ROWS + 1)]
    runner.forward(Batch([BatchEntry.on_pages(r, ctx, 0, t, 16) for r, t in zip(reqs, tables)], 16))

    def decode() -> None:
        step = [BatchEntry.on_pages(r, [7], DECODE_CONTEXT, t, 16) for r, t in zip(reqs, tables)]
        runner.forward(Batch(step, 16))

    long = list(range(4000, 4000 + PREFILL_TOKENS))
    prefill_req = Request("p", long, SamplingParams(max_new_tokens=1))

    def prefill() -> None:
        runner.forward(Batch([BatchEntry.on_pages(prefill_req, long, 0, tables[-1], 16)], 16))

    def best(fn: Callable[[], None], n: int) -> float:
        fn()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    return best(decode, 5), best(prefill, 3)


def measure_in_process(dtype: str, limit_s: float | None = None) -> dict[str, object]:
    """Time and check the engine's forward in ``dtype`` here (run in a child: it may crash).
    A decode step slower than ``limit_s`` is not timed further (``prefill_s`` infinite), but
    its invariance is still checked, so that an explicit ``dtype=`` of it is known exact."""
    loaded = load_model(None, "cpu", dtype)
    cores = os.cpu_count() or 1
    decode_s, prefill_s = _time_forward(loaded, cores)
    if limit_s is not None and decode_s > limit_s:
        prefill_s = float("inf")
    reference = None
    if dtype != "float32":
        reference = invariance.reference_logits(load_model(None, "cpu", "float32"))
    report = invariance.check(loaded, reference)
    native = loaded.model.products is not None and load_kernel() is not None
    return DtypeReport(
        decode_s,
        prefill_s,
        report.invariant,
        report.max_error,
        report.failed,
        invariance.within_tolerance(report, getattr(torch, dtype)),
        native,
    ).to_json()
