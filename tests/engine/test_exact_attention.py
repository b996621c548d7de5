"""Batch-invariant attention: a query's output is bit-identical whether it is attended alone,
in a decode batch, through a cascade run over shared blocks, as part of a prefill chunk, and
with page size 1 or 16, for float32 and bfloat16 pools."""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.attention.exact import (
    attend_decode,
    attend_prefill,
    plan_decode,
    plan_prefill,
)
from engine.model.rows import RowPadding, measure

HKV, G, D = 3, 3, 64
SCALE = D**-0.5


@pytest.fixture(scope="module")
def padding() -> RowPadding:
    found = measure(torch.float32, shapes=((64, 64), (64, 128)), up_to=16, large=(65, 257))
    assert found is not None
    return found


def layout(kv: torch.Tensor, page_size: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Store one sequence's K or V ``[L, HKV, D]`` in shuffled pages of a pool."""
    n_pages = -(-kv.shape[0] // page_size) + 3
    pool = torch.randn(n_pages, page_size, HKV, D).to(kv.dtype)  # stale data around it
    pages = random.Random(seed).sample(range(n_pages), -(-kv.shape[0] // page_size))
    flat = pool.view(-1, HKV, D)
    for pos in range(kv.shape[0]):
        flat[pages[pos // page_size] * page_size + pos % page_size] = kv[pos]
    return pool, pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_gets_the_same_bits_alone_batched_cascaded_prefilled_and_paged(
    dtype: torch.dtype, padding: RowPadding
) -> None:
    gen = torch.Generator().manual_seed(0)
    shared_len, lens = 320, [330, 345, 390, 100]
    prefix_k = torch.randn(shared_len, HKV, D, generator=gen)
    prefix_v = torch.randn(shared_len, HKV, D, generator=gen)
    ks, vs = [], []
    for i, n in enumerate(lens):
        own = n - shared_len if i < 3 else n
        k = torch.randn(own, HKV, D, generator=gen)
        v = torch.randn(own, HKV, D, generator=gen)
        ks.append(torch.cat([prefix_k, k]) if i < 3 else k)
        vs.append(torch.cat([prefix_v, v]) if i < 3 else v)
    ks = [k.to(dtype) for k in ks]
    vs = [v.to(dtype) for v in vs]
    q = torch.randn(len(lens), HKV, G, D, generator=gen)

    def alone(r: int, page_size: int) -> torch.Tensor:
        kp, pages = layout(ks[r], page_size, seed=r)
        vp, vpages = layout(vs[r], page_size, seed=r)
        assert pages == vpages
        plan = plan_decode([0], [pages], [lens[r]], page_size, torch.device("cpu"))
        return attend_decode(q[r : r + 1], kp, vp, plan, padding, SCALE)[0]

    reference = [alone(r, 16) for r in range(len(lens))]
    for r in range(len(lens)):
        assert torch.equal(alone(r, 1), reference[r]), "page size 1 vs 16"

    # one pool holding all four, the first three sharing the prefix's pages: a cascade run
    page_size = 16
    total = shared_len + sum(n - shared_len for n in lens[:3]) + lens[3]
    n_pages = total // page_size + 8
    kp = torch.zeros(n_pages, page_size, HKV, D, dtype=dtype)
    vp = torch.zeros_like(kp)
    free = random.Random(1).sample(range(n_pages), n_pages)
    shared_pages = [free.pop() for _ in range(shared_len // page_size)]
    tables = []
    for r, n in enumerate(lens):
        own_from = shared_len if r < 3 else 0
        pages = (shared_pages if r < 3 else []) + [
            free.pop() for _ in range(-(-n // page_size) - (len(shared_pages) if r < 3 else 0))
        ]
        for pos in range(own_from if r < 3 else 0, n):
            kp.view(-1, HKV, D)[pages[pos // page_size] * page_size + pos % page_size] = ks[r][pos]
            vp.view(-1, HKV, D)[pages[pos // page_size] * page_size + pos % page_size] = vs[r][pos]
        tables.append(pages)
    for pos in range(shared_len):
        slot = shared_pages[pos // page_size] * page_size + pos % page_size
        kp.view(-1, HKV, D)[slot] = prefix_k[pos].to(dtype)
        vp.view(-1, HKV, D)[slot] = prefix_v[pos].to(dtype)
    plan = plan_decode(list(range(4)), tables, lens, page_size, torch.device("cpu"))
    assert plan.shared, "the shared prefix should be attended once (cascade)"
    batched = attend_decode(q, kp, vp, plan, padding, SCALE)
    for r in range(len(lens)):
        assert torch.equal(batched[r], reference[r]), f"request {r}: batched/cascade vs alone"

    # the same query as the last of a prefill chunk of 70 queries
    for r in (0, 3):
        chunk_q = torch.randn(70, HKV, G, D, generator=gen)
        chunk_q[-1] = q[r]
        pplan = plan_prefill(
            (0, 70), tables[r], lens[r], page_size, G, padding, torch.device("cpu")
        )
        out = attend_prefill(chunk_q, kp, vp, pplan, padding, SCALE)
        assert torch.equal(out[-1], reference[r]), f"request {r}: prefill vs decode"
