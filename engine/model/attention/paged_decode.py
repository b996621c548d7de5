"""Decode attention (one query per request) straight on the pool, without copying K/V pages.

A request's pages are mostly runs of consecutive page ids (the allocator hands ids out in
order: a cached prefix and a private tail are a few runs), and a run of pages is a contiguous
range of pool slots, so it can be read as a zero-copy view. Copying every request's pages out
of the pool each layer was most of the decode time. Here each request attends over its views
with two matrix products: scores of all its pieces are concatenated before one softmax (exact,
no rescaling), and the value products of the pieces are summed. Short runs (a scattered tail,
page size 1) would cost more in per-piece calls than in copying, so they are gathered into one
small piece per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

# A run of consecutive pages shorter than this many tokens is gathered instead of viewed.
MIN_VIEW_TOKENS = 32


@dataclass
class DecodePieces:
    """Where one request's K/V lie: pool slot ranges read in place, plus gathered slots."""

    views: list[tuple[int, int]]  # (first slot, number of tokens) per run read in place
    gathered: torch.Tensor | None  # int64 slots of the tokens of the short runs, or None


def split_into_pieces(
    pages: torch.Tensor,
    num_pages: list[int],
    kv_lens: list[int],
    page_size: int,
    min_view_tokens: int = MIN_VIEW_TOKENS,
) -> list[DecodePieces]:
    """Pieces per request, vectorised over the batch (a Python loop only over the viewed runs).

    ``pages`` holds the page tables of all requests back to back (request ``r`` owns
    ``num_pages[r]`` of them); token ``t`` of request ``r`` lies in its page ``t // page_size``.
    """
    if len(num_pages) != len(kv_lens) or sum(num_pages) != pages.numel():
        raise ValueError(
            f"pages: {pages.numel()} page ids for {len(kv_lens)} requests that own "
            f"{sum(num_pages)} pages"
        )
    for r, (n, kv) in enumerate(zip(num_pages, kv_lens)):
        if kv < 1 or n != -(-kv // page_size):
            raise ValueError(
                f"pages: request {r} has {n} pages for {kv} tokens at page_size {page_size}"
            )
    dev = pages.device
    pages = pages.long()
    total = pages.numel()
    req_of_page = torch.repeat_interleave(
        torch.arange(len(kv_lens), device=dev), torch.tensor(num_pages, device=dev)
    )
    first_page = torch.tensor([0, *accumulate(num_pages[:-1])], dtype=torch.int64, device=dev)
    kv_t = torch.tensor(kv_lens, dtype=torch.int64, device=dev)
    # a run starts where the page id does not follow its predecessor, or a request starts
    starts = torch.ones(total, dtype=torch.bool, device=dev)
    starts[1:] = pages[1:] != pages[:-1] + 1
    starts[first_page] = True
    run_first = starts.nonzero().squeeze(1)
    run_end = torch.cat([run_first[1:], torch.tensor([total], device=dev)])
    run_req = req_of_page[run_first]
    base = first_page[run_req]
    tokens = (
        torch.minimum((run_end - base) * page_size, kv_t[run_req]) - (run_first - base) * page_size
    )
    short = tokens < min_view_tokens
    short_runs = torch.bincount(run_req[short], minlength=len(kv_lens))
    in_place = ~short | (short_runs[run_req] <= 1)  # a lone short run is not worth a copy

    views: list[list[tuple[int, int]]] = [[] for _ in kv_lens]
    for r, slot, n in zip(
        run_req[in_place].tolist(),
        (pages[run_first[in_place]] * page_size).tolist(),
        tokens[in_place].tolist(),
    ):
        views[r].append((slot, n))
    gathered: list[torch.Tensor | None] = [None] * len(kv_lens)
    if not bool(in_place.all()):
        gp = torch.repeat_interleave(~in_place, run_end - run_first).nonzero().squeeze(1)
        gp_req = req_of_page[gp]
        offsets = torch.arange(page_size, device=dev)
        token = ((gp - first_page[gp_req]) * page_size)[:, None] + offsets
        valid = token < kv_t[gp_req][:, None]
        slots = (pages[gp] * page_size)[:, None] + offsets
        per_req = torch.bincount(gp_req[:, None].expand_as(valid)[valid], minlength=len(kv_lens))
        for r, part in enumerate(torch.split(slots[valid], per_req.tolist())):
            if part.numel():
                gathered[r] = part
    return [DecodePieces(v, g) for v, g in zip(views, gathered)]


def piece_tensors(
    k_flat: torch.Tensor, v_flat: torch.Tensor, pieces: DecodePieces, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V ``[tokens, Hkv, D]`` of one request's pieces, in token order, in ``dtype``:
    views of the pool for the runs, one gathered copy for the short runs."""
    keys = [k_flat.narrow(0, start, length) for start, length in pieces.views]
    values = [v_flat.narrow(0, start, length) for start, length in pieces.views]
    if pieces.gathered is not None:
        keys.append(k_flat.index_select(0, pieces.gathered))
        values.append(v_flat.index_select(0, pieces.gathered))
    if keys[0].dtype != dtype:
        keys = [k.to(dtype) for k in keys]
        values = [v.to(dtype) for v in values]
    return keys, values


def piece_scores(q: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
    """q ``[Hkv, R, D]`` against key pieces ``[L_i, Hkv, D]`` -> scores ``[Hkv, R, sum L_i]``."""
    if len(keys) == 1:
        return torch.matmul(q, keys[0].permute(1, 2, 0))
    return torch.cat([torch.matmul(q, k.permute(1, 2, 0)) for k in keys], dim=-1)


def weighted_values(probs: torch.Tensor, values: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = probs @ V`` with V given as pieces, each multiplied where it lies (no concat)."""
    offset = 0
    for i, v in enumerate(values):
        p = probs.narrow(-1, offset, v.shape[0])
        if i == 0:
            torch.matmul(p, v.transpose(0, 1), out=out)
        else:
            out.baddbmm_(p, v.transpose(0, 1))
        offset += v.shape[0]


def attend_decode(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    pieces: list[DecodePieces],
    scale: float,
) -> torch.Tensor:
    """q ``[n, Hkv, G, D]`` (G query heads per KV head), pool ``[slots, Hkv, D]`` -> ``[n, Hkv, G, D]``."""
    q = q * scale
    out = torch.empty_like(q)
    for b, req in enumerate(pieces):
        keys, values = piece_tensors(k_flat, v_flat, req, q.dtype)
        probs = piece_scores(q[b], keys).softmax(-1)  # [Hkv, G, total tokens]
        weighted_values(probs, values, out[b])
    return out
