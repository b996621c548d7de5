"""Our paged forward matches transformers' logits (fp32, max abs diff < 1e-4) in every phase."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.model.bringup.platforms import platform_for
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch
from scheduler.request import Request

TOL = 1e-4
TEXT = (
    "The radix tree stores token prefixes so that requests sharing a system prompt reuse "
    "the keys and values computed before. Pages of sixteen tokens make memory easy to manage, "
    "and the scheduler prefers requests whose prefix is already cached, which raises the hit "
    "rate on chat, retrieval and agent workloads alike. Decoding then appends one token per "
    "step to every running request, in one batch."
)


@pytest.fixture(scope="module")
def token_ids(tokenizer: Any) -> list[int]:
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 60
    return list(ids)


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``ids``."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


class Pages:
    """Hands out page ids in a shuffled order so page tables are never contiguous."""

    def __init__(self, num_pages: int, seed: int = 0) -> None:
        self.free = random.Random(seed).sample(range(num_pages), num_pages)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out


def new_runner(loaded: Any, page_size: int, num_tokens: int = 1200) -> tuple[ModelRunner, Pages]:
    cfg = loaded.config
    num_pages = -(-num_tokens // page_size)
    pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return ModelRunner(loaded, pool, platform_for(loaded.device)), Pages(num_pages)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("page_size", [1, 16])
def test_fresh_prefill_matches_transformers_at_every_position(
    make_entry: Any, loaded_fp32: Any, hf_model: Any, token_ids: list[int], page_size: int
) -> None:
    runner, pages = new_runner(loaded_fp32, page_size)
    req = Request("a", token_ids, SamplingParams(max_new_tokens=8))
    batch = Batch([make_entry(req, token_ids, 0, pages.take(len(token_ids)), page_size)], page_size)
    fb = ForwardBatch.from_batch(batch)
    fb.logits_indices = torch.arange(len(token_ids))
    with torch.inference_mode():
        ours = loaded_fp32.model(fb, runner.pool, runner.backend)
    assert max_diff(ours, hf_logits(hf_model, token_ids)) < TOL


@pytest.mark.parametrize("page_size,k", [(16, 15), (16, 16), (16, 17), (16, 32), (1, 16)])
def test_prefill_over_cached_prefix_matches_transformers(
    make_entry: Any, loaded_fp32: Any, hf_model: Any, token_ids: list[int], page_size: int, k: int
) -> None:
    """Request B reuses the pool pages request A wrote for the first k tokens."""
    runner, pages = new_runner(loaded_fp32, page_size)
    prefix_pages = pages.take(-(-k // page_size))
    a = Request("a", token_ids[:k], SamplingParams(max_new_tokens=8))
    runner.forward(
        Batch([make_entry(a, token_ids[:k], 0, prefix_pages, page_size, False)], page_size)
    )
    b = Request("b", token_ids, SamplingParams(max_new_tokens=8))
    b_pages = prefix_pages + pages.take(len(token_ids))
    logits = runner.forward(Batch([make_entry(b, token_ids[k:], k, b_pages, page_size)], page_size))
    assert max_diff(logits[0], hf_logits(hf_model, token_ids)[-1]) < TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_prefilled_in_three_chunks_matches_transformers(
    make_entry: Any, loaded_fp32: Any, hf_model: Any, token_ids: list[int], page_size: int
) -> None:
    runner, pages = new_runner(loaded_fp32, page_size)
    req_pages = pages.take(len(token_ids))
    req = Request("a", token_ids, SamplingParams(max_new_tokens=8))
    ref = hf_logits(hf_model, token_ids)
    bounds = [0, 13, 37, len(token_ids)]  # chunk ends fall mid-page for page_size 16
    for lo, hi in zip(bounds, bounds[1:]):
        logits = runner.forward(
            Batch([make_entry(req, token_ids[lo:hi], lo, req_pages, page_size)], page_size)
        )
        assert max_diff(logits[0], ref[hi - 1]) < TOL


def test_twenty_decode_steps_match_transformers(
    make_entry: Any, loaded_fp32: Any, hf_model: Any, token_ids: list[int]
) -> None:
    page_size = 16
    runner, pages = new_runner(loaded_fp32, page_size)
    prompt = token_ids[:30]
    req = Request("a", prompt, SamplingParams(max_new_tokens=20))
    req_pages = pages.take(len(prompt) + 20)
    seq = list(prompt)
    ours = [runner.forward(Batch([make_entry(req, prompt, 0, req_pages, page_size)], page_size))[0]]
    for _ in range(20):
        seq.append(int(ours[-1].argmax()))
        req.output.append(seq[-1])
        entry = make_entry(req, seq[-1:], len(seq) - 1, req_pages, page_size)
        assert entry.is_decode
        ours.append(runner.forward(Batch([entry], page_size))[0])
    ref = hf_logits(hf_model, seq)
    for step, logits in enumerate(ours):
        assert max_diff(logits, ref[len(prompt) - 1 + step]) < TOL, f"decode step {step}"


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_of_four_phases_matches_transformers(
    make_entry: Any, loaded_fp32: Any, hf_model: Any, token_ids: list[int], page_size: int
) -> None:
    """Fresh prefill, a chunk after a mid-page prefix, and two decodes in one forward pass."""
    runner, pages = new_runner(loaded_fp32, page_size)
    seqs = [token_ids[:23], token_ids[5:61], token_ids[10:29], token_ids[1:44]]
    reqs = [Request(i, s, SamplingParams(max_new_tokens=8)) for i, s in enumerate(seqs)]
    tables = [pages.take(-(-len(s) // page_size)) for s in seqs]
    # Warm-up step: request 1 computes 21 tokens (mid-page); 2 and 3 prefill their prompts.
    warm = [
        make_entry(reqs[1], seqs[1][:21], 0, tables[1], page_size, False),
        make_entry(reqs[2], seqs[2][:-1], 0, tables[2], page_size, False),
        make_entry(reqs[3], seqs[3][:-1], 0, tables[3], page_size, False),
    ]
    runner.forward(Batch(warm, page_size))
    reqs[2].output.append(seqs[2][-1])
    reqs[3].output.append(seqs[3][-1])
    mixed = [
        make_entry(reqs[2], seqs[2][-1:], len(seqs[2]) - 1, tables[2], page_size),
        make_entry(reqs[0], seqs[0], 0, tables[0], page_size),
        make_entry(reqs[3], seqs[3][-1:], len(seqs[3]) - 1, tables[3], page_size),
        make_entry(reqs[1], seqs[1][21:], 21, tables[1], page_size),
    ]
    assert [e.is_decode for e in mixed] == [True, False, True, False]
    logits = runner.forward(Batch(mixed, page_size))
    for row, i in enumerate([2, 0, 3, 1]):
        assert max_diff(logits[row], hf_logits(hf_model, seqs[i])[-1]) < TOL, f"request {i}"
