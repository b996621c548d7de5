"""The torch paged-attention backend equals plain causal attention over each request's tokens."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from decode_cases import run_mixed_batch

from engine.model.attention.torch_backend import (
    MAX_PADDING_RATIO,
    TorchAttentionBackend,
    _group_requests,
)
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from scheduler import SamplingParams
from scheduler.batch import Batch
from scheduler.request import Request

HQ, HKV, D = 6, 2, 16


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
) -> torch.Tensor:
    """q [n, HQ, D] at positions start.., k/v [start + n, HKV, D]: explicit offset-causal softmax."""
    rep = HQ // HKV
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    pos_q = torch.arange(q.shape[0])[:, None] + start
    pos_k = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(make_entry: Any, page_size: int, shapes: list[tuple[int, int]], seed: int = 0) -> None:
    """shapes: (cached prefix length, new tokens) per request; checks every output row."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(s + n) // page_size) for s, n in shapes) + 2
    free = random.Random(seed).sample(range(num_pages), num_pages)
    tables = []
    for start, n in shapes:
        need = -(-(start + n) // page_size)
        tables.append(free[:need])
        free = free[need:]
    run = run_mixed_batch(make_entry, shapes, tables, num_pages, page_size, (HQ, HKV, D), gen)
    for b, (start, _) in enumerate(shapes):
        lo, hi = int(run.batch.qo_indptr[b]), int(run.batch.qo_indptr[b + 1])
        expected = reference_attention(run.q[lo:hi], run.full_k[b], run.full_v[b], start)
        torch.testing.assert_close(run.out[lo:hi], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_mixed_prefill_and_decode_batch_matches_reference(make_entry: Any, page_size: int) -> None:
    shapes = [(0, 9), (17, 1), (5, 12), (0, 1), (31, 1), (16, 16), (7, 3), (0, 40)]
    run_case(make_entry, page_size, shapes)


@pytest.mark.parametrize("start", [15, 16, 17])
def test_prefix_ending_at_before_and_after_page_boundary(make_entry: Any, start: int) -> None:
    run_case(make_entry, 16, [(start, 5)])


def test_uniform_decode_batch_needs_no_mask(make_entry: Any) -> None:
    run_case(make_entry, 16, [(40, 1)] * 4)
    run_case(make_entry, 16, [(47, 1)] * 4)  # page-aligned KV length: no mask at all


@pytest.mark.parametrize("page_size", [1, 4])
def test_one_token_prompts_see_only_themselves(make_entry: Any, page_size: int) -> None:
    run_case(make_entry, page_size, [(0, 1)])
    run_case(make_entry, page_size, [(0, 1)] * 3)


def test_uniform_fresh_prefills_use_plain_causal_attention(make_entry: Any) -> None:
    run_case(make_entry, 4, [(0, 12)] * 3)


def test_fresh_prefills_separated_by_a_decode_share_one_group(make_entry: Any) -> None:
    run_case(make_entry, 4, [(0, 12), (9, 1), (0, 12)])


def test_k_and_v_are_written_at_the_batch_slots(make_entry: Any) -> None:
    pool = KVPool(1, 4, 4, HKV, D)
    entry = make_entry(Request(0, [1] * 6, SamplingParams(max_new_tokens=4)), [1] * 6, 0, [3, 1], 4)
    fb = ForwardBatch.from_batch(Batch([entry], 4))
    backend = TorchAttentionBackend(HQ, HKV, D, torch.device("cpu"))
    backend.plan(fb)
    k, v = torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    backend.run(0, torch.randn(6, HQ, D), k, v, pool)
    torch.testing.assert_close(pool.k_cache[0][3], k[:4])
    torch.testing.assert_close(pool.v_cache[0][1, :2], v[4:])


def test_grouping_puts_all_decodes_together_and_bounds_prefill_padding(make_entry: Any) -> None:
    shapes = [(30, 1), (0, 100), (3, 1), (0, 97), (0, 5), (9, 1), (0, 6)]
    entries = [
        make_entry(Request(i, [0] * (s + n), SamplingParams(max_new_tokens=4)), [0] * n, s, list(range(s + n)), 1)
        for i, (s, n) in enumerate(shapes)
    ]
    fb = ForwardBatch.from_batch(Batch(entries, 1))
    groups = _group_requests(fb)
    assert groups[0] == [0, 2, 5]
    assert sorted(b for g in groups for b in g) == list(range(len(shapes)))
    for g in groups[1:]:
        area = sum(fb.qo_lens[b] * fb.kv_lens[b] for b in g)
        padded = len(g) * max(fb.qo_lens[b] for b in g) * max(fb.kv_lens[b] for b in g)
        assert padded <= MAX_PADDING_RATIO * area
    assert [1, 3] in groups and [4, 6] in groups


def test_run_before_plan_raises() -> None:
    backend = TorchAttentionBackend(HQ, HKV, D, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before plan"):
        backend.run(
            0,
            torch.zeros(1, HQ, D),
            torch.zeros(1, HKV, D),
            torch.zeros(1, HKV, D),
            KVPool(1, 1, 1, HKV, D),
        )
