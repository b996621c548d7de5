"""Cascade decode attention: shared prefix pages are attended once for all the requests that
hold them, and the merged result equals plain attention over each request's own tokens."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from decode_cases import decode_case
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.attention import cascade
from engine.model.attention.cascade import attend_cascade, plan_cascade

HQ, HKV, D = 6, 2, 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [HQ, D], k/v [L, HKV, D]: softmax attention of one query over every key."""
    rep = HQ // HKV
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("hd,khd->hk", q, k) / D**0.5
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


def slots_of(table: list[int], n: int, page_size: int) -> torch.Tensor:
    return torch.tensor([table[t // page_size] * page_size + t % page_size for t in range(n)])


def check_equals_plain_attention(
    tables: list[list[int]], lengths: list[int], page_size: int, seed: int = 0
) -> None:
    num_pages = max(p for t in tables for p in t) + 1
    gen = torch.Generator().manual_seed(seed)
    pool_k = torch.randn(num_pages * page_size, HKV, D, generator=gen) * 3
    pool_v = torch.randn(num_pages * page_size, HKV, D, generator=gen)
    q = torch.randn(len(tables), HQ, D, generator=gen)
    plan = plan_cascade(tables, lengths, page_size, min_saved_tokens=1)
    assert plan is not None
    out = attend_cascade(q.view(len(tables), HKV, -1, D), pool_k, pool_v, plan, D**-0.5)
    for b, (table, n) in enumerate(zip(tables, lengths)):
        slots = slots_of(table, n, page_size)
        expected = reference(q[b], pool_k[slots], pool_v[slots])
        torch.testing.assert_close(out[b].reshape(HQ, D), expected, atol=1e-5, rtol=1e-5)


def test_requests_holding_the_same_prefix_pages_form_one_shared_segment() -> None:
    prefix = [10, 11, 12, 13]
    tables = [prefix + [20], prefix + [21, 22], [30, 31, 32]]
    plan = plan_cascade(tables, [66, 90, 40], 16, min_saved_tokens=1)
    assert plan is not None
    (seg,) = plan.shared
    assert seg.members.tolist() == [0, 1]
    assert seg.views == [(160, 64)]  # pages 10-13: one run of 64 tokens read in place
    assert plan.num_shared_tokens == 64
    # each request also has a tail: the pages after the shared prefix (or all, if none)
    assert plan.part_owner.tolist().count(0) == 2 and plan.part_owner.tolist().count(2) == 1


def test_nested_sharing_gives_a_segment_per_level_of_the_trie() -> None:
    root, left, right = [0, 1, 2, 3], [4, 5], [6, 7]
    tables = [root + left + [8], root + left + [9], root + right + [10], root + right + [11]]
    plan = plan_cascade(tables, [4 * 7 + 1] * 4, 4, min_saved_tokens=1)
    assert plan is not None
    shared = sorted((s.members.tolist(), s.views) for s in plan.shared)
    assert shared == [([0, 1], [(16, 8)]), ([0, 1, 2, 3], [(0, 16)]), ([2, 3], [(24, 8)])]


def test_a_prefix_too_short_to_pay_for_itself_is_not_shared() -> None:
    tables = [[0, 1, 5], [0, 1, 6]]
    assert plan_cascade(tables, [40, 40], 16) is None  # spares 32 token reads < 256
    assert plan_cascade(tables, [40, 40], 16, min_saved_tokens=32) is not None


def test_a_lone_request_or_no_common_page_needs_no_cascade() -> None:
    assert plan_cascade([[0, 1, 2]], [40], 16, min_saved_tokens=1) is None
    assert plan_cascade([[0, 1], [2, 3]], [20, 20], 16, min_saved_tokens=1) is None


def test_the_page_being_written_is_never_shared() -> None:
    # both tables end on page 7, but neither has filled it: only full pages are shared
    plan = plan_cascade([[5, 6, 7], [5, 6, 7]], [40, 40], 16, min_saved_tokens=1)
    assert plan is not None
    (seg,) = plan.shared
    assert seg.views == [(80, 32)]


@pytest.mark.parametrize("batched", [True, False], ids=["tails batched", "tails per request"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_cascade_equals_plain_attention(
    page_size: int, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not batched:
        monkeypatch.setattr(cascade, "MAX_BATCHED_TAIL_TOKENS", 0)
    rng = random.Random(page_size)
    prefix_pages = -(-96 // page_size)
    prefix = list(range(prefix_pages))
    nxt = prefix_pages
    tables, lengths = [], []
    for tail in (5, 40, 17, 60):  # tokens after the prefix
        n = prefix_pages * page_size + tail
        own = list(range(nxt, nxt + -(-tail // page_size)))
        nxt += len(own)
        tables.append(prefix + own)
        lengths.append(n)
    tables.append([nxt + i for i in rng.sample(range(10), 4)])  # a request sharing nothing
    lengths.append(3 * page_size + 1)
    check_equals_plain_attention(tables, lengths, page_size)


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    shapes=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 12)),
        min_size=2,
        max_size=7,
    ),
)
def test_cascade_equals_plain_attention_for_any_trie_of_prefixes(
    page_size: int, shapes: list[tuple[int, int, int]]
) -> None:
    """Requests pick one of 4 roots and one of 3 branches below it (pages shared by whoever
    picks the same), then private pages: every trie of prefixes a radix cache can make."""
    roots = {r: [100 + 10 * r + i for i in range(3)] for r in range(4)}
    branches = {
        (r, b): [300 + 10 * (3 * r + b) + i for i in range(2)] for r in range(4) for b in range(3)
    }
    tables, lengths = [], []
    nxt = 1000
    for r, b, tail in shapes:
        own = list(range(nxt, nxt + -(-tail // page_size)))
        nxt += len(own) + 1  # keep private runs apart
        tables.append(roots[r] + branches[(r, b)] + own)
        lengths.append(5 * page_size + tail)
    if plan_cascade(tables, lengths, page_size, min_saved_tokens=1) is None:
        return  # nothing shared: the per-request path, tested in test_paged_decode
    check_equals_plain_attention(tables, lengths, page_size, seed=len(shapes))


def test_backend_decodes_a_shared_prefix_batch_through_the_cascade(make_entry: Any) -> None:
    """Through the backend: 6 decodes over one 320-token prefix equal plain attention."""
    prefix = list(range(20))
    tables = [prefix + [20 + 2 * i, 21 + 2 * i] for i in range(6)]
    lengths = [320 + 5 + 3 * i for i in range(6)]
    case = decode_case(make_entry, tables, lengths, 16, HQ, HKV, D, seed=7)
    out, backend = case.run(HQ)
    (group,) = backend._groups
    assert group.cascade is not None and group.cascade.num_shared_tokens == 320
    for b in range(len(tables)):
        torch.testing.assert_close(out[b], case.expected(b), atol=1e-5, rtol=1e-5)
