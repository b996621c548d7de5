"""Decode attention read in place from the pool: runs of pages become views, short runs are
gathered, and the result equals plain attention over each request's tokens."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from decode_cases import decode_case, run_mixed_batch

from engine.model.attention.paged_decode import attend_decode, split_into_pieces

HQ, HKV, D = 6, 2, 16


def pieces_of(tables: list[list[int]], kv_lens: list[int], page_size: int, min_view: int = 32):
    flat = torch.tensor([p for t in tables for p in t], dtype=torch.int32)
    return split_into_pieces(flat, [len(t) for t in tables], kv_lens, page_size, min_view)


def test_one_run_of_pages_is_one_view_cut_at_the_kv_length() -> None:
    (req,) = pieces_of([[5, 6, 7]], [37], 16)
    assert req.views == [(80, 37)] and req.gathered is None


def test_long_runs_are_views_and_short_runs_are_gathered_in_token_order() -> None:
    # 4-token pages: pages 10-17 (32 tokens), then 3, 30 and 50 (scattered), then 60-68 (34 tokens)
    table = [*range(10, 18), 3, 30, 50, *range(60, 69)]
    (req,) = pieces_of([table], [len(table) * 4 - 2], 4)
    assert req.views == [(40, 32), (240, 34)]
    assert req.gathered is not None
    assert req.gathered.tolist() == [*range(12, 16), *range(120, 124), *range(200, 204)]


def test_a_lone_short_run_is_read_in_place() -> None:
    (req,) = pieces_of([[*range(0, 8), 20]], [33], 4)
    assert req.views == [(0, 32), (80, 1)] and req.gathered is None


def test_requests_split_independently_even_when_their_pages_touch() -> None:
    # request 0 ends on page 3, request 1 starts on page 4: still two requests, two views
    a, b = pieces_of([[0, 1, 2, 3], [4, 5]], [16, 7], 4)
    assert a.views == [(0, 16)] and b.views == [(16, 7)]


def test_gathered_tail_stops_at_the_kv_length() -> None:
    (req,) = pieces_of([[9, 2, 7]], [10], 4, min_view=100)
    assert req.views == [] and req.gathered is not None
    assert req.gathered.tolist() == [36, 37, 38, 39, 8, 9, 10, 11, 28, 29]


def test_page_counts_that_do_not_fit_the_lengths_raise_value_error() -> None:
    with pytest.raises(ValueError, match="pages"):
        pieces_of([[0, 1]], [40], 16)
    with pytest.raises(ValueError, match="pages"):
        split_into_pieces(torch.tensor([0, 1, 2]), [2], [20], 16)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [HQ, D] of the last position, k/v [L, HKV, D]: softmax attention over every key."""
    rep = HQ // HKV
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("hd,khd->hk", q, k) / D**0.5
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


def layout(kind: str, page_size: int, lengths: list[int]) -> tuple[int, list[list[int]]]:
    """Page tables of several shapes allocators produce; returns (pool pages, tables)."""
    needs = [-(-n // page_size) for n in lengths]
    if kind == "contiguous":
        starts = [sum(needs[:i]) for i in range(len(needs))]
        return sum(needs) + 1, [list(range(s, s + n)) for s, n in zip(starts, needs)]
    if kind in ("shared prefix, interleaved tails", "private runs, interleaved tails"):
        prefix = min(needs) // 2
        tails = [n - prefix for n in needs]
        tables = [list(range(prefix)) for _ in needs]
        nxt = prefix
        if kind.startswith("private"):
            tables = [list(range(i * prefix, (i + 1) * prefix)) for i in range(len(needs))]
            nxt = prefix * len(needs)
        for step in range(max(tails)):  # tails grow one page per request in turn
            for t, tail in zip(tables, tails):
                if step < tail:
                    t.append(nxt)
                    nxt += 1
        return nxt + 1, tables
    total = sum(needs) + 3
    free = random.Random(1).sample(range(total), total)
    starts = [sum(needs[:i]) for i in range(len(needs))]
    return total, [free[s : s + n] for s, n in zip(starts, needs)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(
    "kind",
    [
        "contiguous",
        "shared prefix, interleaved tails",
        "private runs, interleaved tails",
        "scattered",
    ],
)
def test_attend_decode_equals_plain_attention(page_size: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(page_size)
    lengths = [80, 70, 100, 130, 90] if kind.endswith("tails") else [1, 17, 64, 100, 130]
    num_pages, tables = layout(kind, page_size, lengths)
    pool_k = torch.randn(num_pages * page_size, HKV, D, generator=gen)
    pool_v = torch.randn(num_pages * page_size, HKV, D, generator=gen)
    q = torch.randn(len(lengths), HQ, D, generator=gen)
    pieces = pieces_of(tables, lengths, page_size)
    out = attend_decode(q.view(len(lengths), HKV, -1, D), pool_k, pool_v, pieces, D**-0.5)
    for b, (table, n) in enumerate(zip(tables, lengths)):
        slots = torch.tensor([table[t // page_size] * page_size + t % page_size for t in range(n)])
        expected = reference(q[b], pool_k[slots], pool_v[slots])
        torch.testing.assert_close(out[b].reshape(HQ, D), expected, atol=1e-5, rtol=1e-5)


def test_half_precision_pool_is_read_in_the_query_dtype() -> None:
    gen = torch.Generator().manual_seed(0)
    pool_k = torch.randn(64, HKV, D, generator=gen).to(torch.bfloat16)
    pool_v = torch.randn(64, HKV, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, HQ, D, generator=gen)
    pieces = pieces_of([[0, 1, 2, 3]], [50], 16)
    out = attend_decode(q.view(1, HKV, -1, D), pool_k, pool_v, pieces, D**-0.5)
    expected = reference(q[0], pool_k[:50].float(), pool_v[:50].float())
    torch.testing.assert_close(out[0].reshape(HQ, D), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decodes_between_prefills_with_runs_of_pages_match_plain_attention(
    make_entry: Any, page_size: int
) -> None:
    """Prefill, decode, prefill, decode: decodes are not adjacent and read runs of pages."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(0, 70), (100, 1), (64, 8), (90, 1)]  # (cached prefix, new tokens)
    lengths = [s + n for s, n in shapes]
    num_pages, tables = layout("private runs, interleaved tails", page_size, lengths)
    run = run_mixed_batch(make_entry, shapes, tables, num_pages, page_size, (HQ, HKV, D), gen)
    for b, (_, n) in enumerate(shapes):
        if n != 1:
            continue
        row = int(run.batch.qo_indptr[b])
        expected = reference(run.q[row], run.full_k[b], run.full_v[b])
        torch.testing.assert_close(run.out[row], expected, atol=1e-5, rtol=1e-5)


def test_one_query_head_per_kv_head_attends_in_place(make_entry: Any) -> None:
    """No grouped heads (Hq == Hkv): decodes still take the in-place path and stay exact."""
    tables = [[*range(0, 10), 40, 30], [*range(10, 20), 41]]
    lengths = [46, 41]
    case = decode_case(make_entry, tables, lengths, 4, 3, 3, D, seed=5)
    out, _ = case.run(3)
    for b in range(len(tables)):
        torch.testing.assert_close(out[b], case.expected(b), atol=1e-5, rtol=1e-5)
