"""Is the engine's forward batch-invariant on this machine? Checked on the real model.

A product probed alone can pass while the model's passes break (seen: oneDNN's bf16 path on a
Zen 4 EPYC), so the check runs the engine's own forward (``ModelRunner``) on the loaded model:
one prompt whole, in chunks ending in a one-token step, and inside batches with other
requests' rows (prefills and decodes), at one thread and at every core, with page sizes 16 and
1. The last token's logits must be equal bit for bit in every case, and within tolerance of
the float32 reference (an invariant kernel can still be wrong).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.model.bringup.platforms import platform_for
from engine.model.cpu.threads import ThreadPolicy
from engine.model.kv_pool import KVPool
from engine.model.loader import LoadedModel
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request

# Relative error (max |logit - reference| / max |reference|) allowed against float32: bf16
# weights with bf16-rounded activations land near 1e-2 on SmolLM2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.08, torch.float16: 0.08}
PROMPT = list(range(1000, 1067))  # 67 tokens: a 64-key block and a partial one
OTHERS = (list(range(3000, 3041)), list(range(5000, 5005)))


@dataclass(frozen=True)
class InvarianceReport:
    invariant: bool  # the prompt's logits equal bit for bit in every case
    failed: tuple[str, ...]  # the cases that differed from the whole pass
    max_error: float  # relative to the float32 reference (0.0 when no reference was given)

    def to_json(self) -> dict[str, object]:
        return {"invariant": self.invariant, "failed": list(self.failed), "error": self.max_error}


def last_logits(
    runner: ModelRunner, pieces: list[list[list[int]]], sample_all: bool = False
) -> torch.Tensor:
    """Feed each request's chunks, chunk i of every request in pass i; request 0's last
    token's logits (request 0 is the prompt, the rest only share its passes). With
    ``sample_all`` every chunk's last token is sampled (decode passes as the engine runs
    them: what a decode graph takes), else only each request's last chunk's."""
    ps = runner.pool.page_size
    per = runner.pool.num_pages // len(pieces)
    tables = [list(range(r * per, (r + 1) * per)) for r in range(len(pieces))]
    done = [0] * len(pieces)
    found: torch.Tensor | None = None
    for step in range(max(len(p) for p in pieces)):
        entries = []
        for r, chunks in enumerate(pieces):
            if step < len(chunks):
                req = Request(f"r{r}", chunks[step], SamplingParams(max_new_tokens=1))
                last = sample_all or step == len(chunks) - 1
                entries.append(BatchEntry.on_pages(req, chunks[step], done[r], tables[r], ps, last))
                done[r] += len(chunks[step])
        logits = runner.forward(Batch(entries, ps))
        if step == len(pieces[0]) - 1:
            found = logits[0].clone()
    assert found is not None
    return found


def runner_for(
    loaded: LoadedModel, page_size: int, threads: int, tokens: int = 1536
) -> ModelRunner:
    cfg = loaded.config
    pool = KVPool(
        cfg.num_layers, tokens // page_size, page_size, cfg.num_kv_heads, cfg.head_dim,
        loaded.dtype,
    )
    platform = platform_for(loaded.device, "torch", ThreadPolicy(threads))
    return ModelRunner(loaded, pool, platform, batch_invariant=True)


def check(loaded: LoadedModel, reference: torch.Tensor | None = None) -> InvarianceReport:
    """Run the cases on ``loaded`` (CPU); ``reference``: float32 logits of PROMPT's last token
    (see ``reference_logits``)."""
    ids = PROMPT
    n = len(ids)
    chunked = [ids[:7], ids[7:36], ids[36 : n - 1], ids[n - 1 :]]
    a, b = OTHERS
    cores = os.cpu_count() or 1
    before = torch.get_num_threads()
    try:
        whole = last_logits(runner_for(loaded, 16, 1), [[ids]])
        cases: dict[str, torch.Tensor] = {}
        for threads in sorted({1, cores}):
            r16 = runner_for(loaded, 16, threads)
            cases[f"whole, {threads} threads"] = last_logits(r16, [[ids]])
            cases[f"chunked, {threads} threads"] = last_logits(r16, [chunked])
            # the prompt's passes shared with a longer prefill and a prefill then decodes
            cases[f"batched, {threads} threads"] = last_logits(
                r16, [chunked, [a[:20], a[20:]], [b, [7], [8], [9]]]
            )
            cases[f"batched whole, {threads} threads"] = last_logits(
                r16, [[ids], [a], [b[:1]]]
            )
            r1 = runner_for(loaded, 1, threads)
            cases[f"page size 1, {threads} threads"] = last_logits(r1, [[ids[:30], ids[30:]]])
    finally:
        torch.set_num_threads(before)
    failed = tuple(name for name, got in cases.items() if not torch.equal(got, whole))
    error = 0.0
    if reference is not None:
        error = float((whole - reference).abs().max() / reference.abs().max())
    return InvarianceReport(not failed, failed, error)


def reference_logits(loaded_fp32: LoadedModel) -> torch.Tensor:
    """The float32 model's logits for PROMPT's last token, in one pass."""
    return last_logits(runner_for(loaded_fp32, 16, 1), [[PROMPT]])


def within_tolerance(report: InvarianceReport, dtype: torch.dtype) -> bool:
    return report.max_error <= TOLERANCE.get(dtype, 0.08)
