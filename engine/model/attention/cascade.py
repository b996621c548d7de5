"""Cascade decode attention: a prefix that several requests of a decode batch share is read
once for all of them.

With the prefix cache on, requests that share a prompt prefix point at the same pool pages, and
plain per-request decode attention reads those pages once per request: at 64 requests over 8
shared 1,000-token prefixes, 8 times more K/V than there is. Here the batch's page tables are
split like a trie: a run of pages that several requests hold at the same positions becomes a
*shared segment*, attended once with the queries of all its members stacked (one matrix product
per KV head), and each request's remaining tokens are its *tail*. Every part returns an
unnormalised output with its row maxima and sums, and the parts of a request are merged by
log-sum-exp, which is exact (the same softmax over the union of the keys).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from engine.model.attention.paged_decode import (
    DecodePieces,
    piece_scores,
    piece_tensors,
    split_into_pieces,
    weighted_values,
)

# A shared segment is attended on its own only when it spares at least this many token reads
# ((members - 1) * tokens): below that, its fixed per-layer cost is more than it saves.
MIN_SAVED_TOKENS = 256
# Tails are gathered into one padded batch (a few calls per layer instead of a few per request)
# when the longest is at most this many tokens and padding adds at most half again.
MAX_BATCHED_TAIL_TOKENS = 256
MAX_TAIL_PADDING_RATIO = 1.5


@dataclass
class SharedSegment:
    """Tokens that every member request attends: pool slot ranges read in place."""

    members: torch.Tensor  # int64 rows of the decode batch
    views: list[tuple[int, int]]  # (first slot, number of tokens)
    first_part: int  # the members' parts are first_part .. first_part + len(members) - 1


@dataclass
class BatchedTails:
    """Every tail gathered by whole pages into one padded batch, -inf on the padding."""

    rows: torch.Tensor  # int64 requests with a tail
    pages: torch.Tensor  # int64 [len(rows), pages of the longest]; padding repeats a page
    bias: torch.Tensor | None  # float [1, len(rows), 1, tokens]: 0 or -inf; None: no padding
    page_size: int
    first_part: int  # the tails' parts are first_part .. first_part + len(rows) - 1


@dataclass
class CascadePlan:
    """How one decode batch is attended: shared segments, then each request's tail."""

    shared: list[SharedSegment]
    tails: list[DecodePieces | None]  # per request: tokens after its shared segments
    tail_part: list[int]  # per request: its tail's part index (-1: no tail)
    part_owner: torch.Tensor  # int64 [parts]: the request each part belongs to
    num_parts: int
    batched_tails: BatchedTails | None = None  # set instead of ``tails`` when tails are short

    @property
    def num_shared_tokens(self) -> int:
        return sum(n for s in self.shared for _, n in s.views)


def plan_cascade(
    tables: list[list[int]],
    kv_lens: list[int],
    page_size: int,
    min_saved_tokens: int = MIN_SAVED_TOKENS,
    device: torch.device | str = "cpu",
) -> CascadePlan | None:
    """Shared segments and tails for requests with page tables ``tables``; None if no prefix is
    worth sharing (then plain per-request attention is cheaper).

    Only full pages can be shared: a request writes its current token into a page of its own.
    """
    n = len(tables)
    if n < 2:
        return None
    full = [kv // page_size for kv in kv_lens]
    segments, tail_start = shared_runs(
        [t[:f] for t, f in zip(tables, full)], page_size, min_saved_tokens
    )
    if not segments:
        return None

    owner: list[int] = []
    shared: list[SharedSegment] = []
    for rs, a, b in segments:
        views = _page_runs(tables[rs[0]][a:b], page_size)
        members = torch.tensor(rs, dtype=torch.int64, device=device)
        shared.append(SharedSegment(members, views, len(owner)))
        owner.extend(rs)

    tails: list[DecodePieces | None] = [None] * n
    tail_part = [-1] * n
    with_tail = [r for r in range(n) if tail_start[r] * page_size < kv_lens[r]]
    tail_lens = [kv_lens[r] - tail_start[r] * page_size for r in with_tail]
    if with_tail and _worth_batching(tail_lens):
        first = len(owner)
        owner.extend(with_tail)
        batched = _batch_tails(tables, with_tail, tail_start, tail_lens, page_size, device)
        batched.first_part = first
        part_owner = torch.tensor(owner, dtype=torch.int64, device=device)
        return CascadePlan(shared, tails, tail_part, part_owner, len(owner), batched)
    if with_tail:
        pages = torch.tensor(
            [p for r in with_tail for p in tables[r][tail_start[r] :]],
            dtype=torch.int64,
            device=device,
        )
        pieces = split_into_pieces(
            pages,
            [len(tables[r]) - tail_start[r] for r in with_tail],
            [kv_lens[r] - tail_start[r] * page_size for r in with_tail],
            page_size,
        )
        for r, piece in zip(with_tail, pieces):
            tails[r] = piece
            tail_part[r] = len(owner)
            owner.append(r)
    part_owner = torch.tensor(owner, dtype=torch.int64, device=device)
    return CascadePlan(shared, tails, tail_part, part_owner, len(owner))


def shared_runs(
    keys: list[Sequence[Hashable]], unit_tokens: int, min_saved_tokens: int
) -> tuple[list[tuple[list[int], int, int]], list[int]]:
    """A trie over the requests' storage units (``keys[r]``: request r's full pages or blocks,
    in order): runs ``(members, first unit, end unit)`` that several requests hold at the same
    positions and that spare at least ``min_saved_tokens`` reads, and per request the unit
    where its own tail begins."""
    tail_start = [0] * len(keys)
    runs: list[tuple[list[int], int, int]] = []
    stack: list[tuple[list[int], int]] = [(list(range(len(keys))), 0)]
    while stack:
        members, depth = stack.pop()
        by_key: dict[Hashable, list[int]] = {}
        for r in members:
            if len(keys[r]) > depth:
                by_key.setdefault(keys[r][depth], []).append(r)
            else:
                tail_start[r] = depth
        for rs in by_key.values():
            if len(rs) > 1:
                limit = min(len(keys[r]) for r in rs)
                end = depth + 1
                while end < limit and all(keys[r][end] == keys[rs[0]][end] for r in rs[1:]):
                    end += 1
                if (len(rs) - 1) * (end - depth) * unit_tokens >= min_saved_tokens:
                    runs.append((rs, depth, end))
                    stack.append((rs, end))
                    continue
            for r in rs:
                tail_start[r] = depth
    return runs, tail_start


def _worth_batching(tail_lens: list[int]) -> bool:
    longest = max(tail_lens)
    return longest <= MAX_BATCHED_TAIL_TOKENS and longest * len(
        tail_lens
    ) <= MAX_TAIL_PADDING_RATIO * sum(tail_lens)


def _batch_tails(
    tables: list[list[int]],
    rows: list[int],
    tail_start: list[int],
    tail_lens: list[int],
    page_size: int,
    device: torch.device | str,
) -> BatchedTails:
    """Tails are read by whole pages (a page is one contiguous row of the pool: far cheaper to
    gather than its tokens one by one); tokens past a tail's length are masked."""
    num_pages = -(-max(tail_lens) // page_size)
    padded_pages = []
    for r in rows:
        own = tables[r][tail_start[r] :]
        padded_pages.append(own + [own[0]] * (num_pages - len(own)))
    pages = torch.tensor(padded_pages, dtype=torch.int64, device=device)
    token = torch.arange(num_pages * page_size, device=device)
    valid = token[None, :] < torch.tensor(tail_lens, dtype=torch.int64, device=device)[:, None]
    bias: torch.Tensor | None = None
    if not bool(valid.all()):
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=device)
        bias.masked_fill_(~valid, float("-inf"))
        bias = bias[None, :, None, :]
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    return BatchedTails(rows_t, pages, bias, page_size, 0)


def _page_runs(pages: list[int], page_size: int) -> list[tuple[int, int]]:
    """(first slot, tokens) per run of consecutive page ids."""
    runs: list[tuple[int, int]] = []
    start = prev = pages[0]
    for p in pages[1:]:
        if p != prev + 1:
            runs.append((start * page_size, (prev - start + 1) * page_size))
            start = p
        prev = p
    runs.append((start * page_size, (prev - start + 1) * page_size))
    return runs


def attend_cascade(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    plan: CascadePlan,
    scale: float,
) -> torch.Tensor:
    """q ``[n, Hkv, G, D]`` (G query heads per KV head), pool ``[slots, Hkv, D]`` -> ``[n, Hkv, G, D]``."""
    n, hkv, g, d = q.shape
    q = q * scale
    parts_out = q.new_empty((plan.num_parts, hkv, g, d))
    parts_max = q.new_empty((plan.num_parts, hkv, g, 1))
    parts_sum = q.new_empty((plan.num_parts, hkv, g, 1))

    for seg in plan.shared:
        m = seg.members.numel()
        qs = q.index_select(0, seg.members).transpose(0, 1).reshape(hkv, m * g, d)
        keys, values = piece_tensors(k_flat, v_flat, DecodePieces(seg.views, None), q.dtype)
        out, mx, total = (
            qs.new_empty(qs.shape),
            qs.new_empty((hkv, m * g, 1)),
            qs.new_empty((hkv, m * g, 1)),
        )
        _partial_attention(qs, keys, values, (out, mx, total))
        a, b = seg.first_part, seg.first_part + m
        parts_out[a:b] = out.view(hkv, m, g, d).transpose(0, 1)
        parts_max[a:b] = mx.view(hkv, m, g, 1).transpose(0, 1)
        parts_sum[a:b] = total.view(hkv, m, g, 1).transpose(0, 1)

    if plan.batched_tails is not None:
        _attend_batched_tails(
            q, k_flat, v_flat, plan.batched_tails, parts_out, parts_max, parts_sum
        )

    for r, tail in enumerate(plan.tails):
        if tail is None:
            continue
        keys, values = piece_tensors(k_flat, v_flat, tail, q.dtype)
        i = plan.tail_part[r]
        _partial_attention(q[r], keys, values, (parts_out[i], parts_max[i], parts_sum[i]))

    # log-sum-exp merge of each request's parts
    owner = plan.part_owner
    row_max = parts_max.new_full((n, hkv, g, 1), float("-inf"))
    row_max.scatter_reduce_(0, owner.view(-1, 1, 1, 1).expand_as(parts_max), parts_max, "amax")
    weight = (parts_max - row_max.index_select(0, owner)).exp_()
    numer = q.new_zeros((n, hkv, g, d)).index_add_(0, owner, parts_out.mul_(weight))
    denom = q.new_zeros((n, hkv, g, 1)).index_add_(0, owner, parts_sum.mul_(weight))
    return numer.div_(denom)


def _attend_batched_tails(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    bt: BatchedTails,
    parts_out: torch.Tensor,
    parts_max: torch.Tensor,
    parts_sum: torch.Tensor,
) -> None:
    """Partial attention of every tail at once, one matrix product per KV head and side.

    The gathered K/V stay ``[rows, tokens, Hkv, D]``: each head's slice is a strided batch of
    matrices the BLAS reads as is, where a head-major permute would copy them all."""
    _, hkv, g, d = q.shape
    rows, num_pages = bt.pages.shape
    tokens = num_pages * bt.page_size
    flat_pages = bt.pages.reshape(-1)
    keys = k_flat.view(-1, bt.page_size * hkv * d).index_select(0, flat_pages)
    values = v_flat.view(-1, bt.page_size * hkv * d).index_select(0, flat_pages)
    keys, values = keys.view(rows, tokens, hkv, d), values.view(rows, tokens, hkv, d)
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    qt = q.index_select(0, bt.rows)
    scores = q.new_empty((hkv, rows, g, tokens))
    for h in range(hkv):
        torch.bmm(qt[:, h], keys[:, :, h].transpose(1, 2), out=scores[h])
    if bt.bias is not None:
        scores.add_(bt.bias.to(scores.dtype))
    mx = scores.amax(-1, keepdim=True)
    probs = scores.sub_(mx).exp_()
    out = q.new_empty((hkv, rows, g, d))
    for h in range(hkv):
        torch.bmm(probs[h], values[:, :, h], out=out[h])
    a, b = bt.first_part, bt.first_part + rows
    parts_out[a:b] = out.transpose(0, 1)
    parts_max[a:b] = mx.transpose(0, 1)
    parts_sum[a:b] = probs.sum(-1, keepdim=True).transpose(0, 1)


def _partial_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Unnormalised attention of q ``[Hkv, R, D]`` (pre-scaled) over K/V pieces ``[L, Hkv, D]``
    into ``out`` = ``(sum_j exp(s_j - max) v_j, max, sum_j exp(s_j - max))`` per row."""
    acc, mx, total = out
    scores = piece_scores(q, keys)
    torch.amax(scores, -1, keepdim=True, out=mx)
    probs = scores.sub_(mx).exp_()
    torch.sum(probs, -1, True, out=total)
    weighted_values(probs, values, acc)
