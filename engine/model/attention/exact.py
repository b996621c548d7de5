"""Batch-invariant paged attention: a query's output depends only on its own keys.

Whether a prompt's prefix came from the cache or was computed just now, whether a query runs
alone, in a batch of 16, in a prefill chunk or in a decode step, and whether its prefix was
read once for several requests (cascade) or for it alone, every number on its way is computed
by the same operations in the same order:

- keys are cut into blocks of ``BLOCK`` tokens at fixed absolute positions (0, 64, 128, ...),
  whatever the page size and wherever pages or chunks begin;
- scores are ``q @ K^T`` over head_dim with the row count padded (``RowPadding``) so the BLAS
  kernel is the same one for every batch; the row maximum over all keys is exact in any order;
- ``exp(s - max)``, a per-block sum over exactly ``BLOCK`` entries and a per-block product
  ``P_b @ V_b`` (reduction over exactly ``BLOCK`` keys) give each block's partials;
- the partials are folded block by block in position order by ``cumsum`` (sequential, in
  double precision on the CPU); blocks past a query's position are exact zeros, so how many
  trailing blocks a batch pads with never changes the sum.

Attention runs in float32 whatever the model's dtype (q, K and V are upcast): its FLOPs are a
small part of the forward pass, and one set of measured kernels serves every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.attention.cascade import shared_runs
from engine.model.rows import RowPadding

BLOCK = 64  # tokens per key block: the fixed unit of every reduction over keys
# Prefill queries are attended in tiles of this many tokens (bounds the score matrix).
PREFILL_TILE_TOKENS = 256
# A run of blocks several decoding requests share is attended once for all of them when it
# spares at least this many token reads ((members - 1) * tokens).
MIN_SAVED_TOKENS = 256
# Decode tails are batched together while padding adds at most half again.
MAX_TAIL_PADDING_RATIO = 1.5


@dataclass
class KeyGather:
    """Where the keys of ``units`` key ranges of ``blocks`` blocks each lie in the pool:
    page ids (``by_page``) or slot ids, ``[units, blocks * per_block]`` as one flat index."""

    index: torch.Tensor  # int64, flat
    units: int
    blocks: int
    by_page: bool

    @property
    def tokens(self) -> int:
        return self.blocks * BLOCK

    def read(self, pages: torch.Tensor) -> torch.Tensor:
        """``[units, blocks * BLOCK, Hkv, D]`` gathered from a layer's pool tensor
        ``[num_pages, page_size, Hkv, D]``."""
        num_pages, page_size, hkv, d = pages.shape
        if self.by_page:
            rows = pages.view(num_pages, page_size * hkv * d).index_select(0, self.index)
        else:
            rows = pages.view(num_pages * page_size, hkv * d).index_select(0, self.index)
        return rows.view(self.units, self.tokens, hkv, d)


@dataclass
class SharedRun:
    """Blocks ``first_block .. first_block + gather.blocks - 1`` that every member shares."""

    members: torch.Tensor  # int64 rows of the decode group
    num_members: int
    first_block: int
    gather: KeyGather  # one unit
    at: torch.Tensor | None = None  # int64 [members * blocks]: rows of the plan's fold


@dataclass
class TailGroup:
    """The private blocks of some decoding requests, batched (padding blocks are masked)."""

    rows: torch.Tensor  # int64 rows of the decode group
    first_block: torch.Tensor  # int64 per row: the absolute index of its first tail block
    gather: KeyGather  # one unit per row
    mask: torch.Tensor | None  # bool [rows, 1, 1, tokens]: True where a key is past the query
    at: torch.Tensor | None = None  # int64 [rows * blocks]: rows of the plan's fold


@dataclass
class DecodePlan:
    """One query per request: shared runs (cascade), then each request's own blocks."""

    tokens: torch.Tensor  # int64 positions of the group's queries in the pass's flat q
    shared: list[SharedRun]
    tails: list[TailGroup]
    num_blocks: int  # blocks of the longest request, padding included


@dataclass
class PrefillTile:
    """Queries ``[a, b)`` of a chunk: they see at most ``length`` keys (whole blocks)."""

    a: int
    b: int
    length: int
    mask: torch.Tensor  # bool [1, 1, padded rows, length]: True where a key is past the query


@dataclass
class PrefillPlan:
    """Several queries of one request (a prefill chunk), attended in tiles of tokens."""

    tokens: tuple[int, int]  # [a, b) in the pass's flat q
    gather: KeyGather  # one unit: every block up to the last query's position
    tiles: list[PrefillTile]


def _block_index(pages: list[int], kv_len: int, block: int, page_size: int) -> list[int]:
    """Gather indices (pages when page_size divides BLOCK, else slots) of block ``block`` of a
    request; positions past ``kv_len`` read a valid place that the mask hides."""
    if BLOCK % page_size == 0:
        per = BLOCK // page_size
        first = block * per
        return [pages[i] if i < len(pages) else pages[0] for i in range(first, first + per)]
    out = []
    for pos in range(block * BLOCK, (block + 1) * BLOCK):
        p = pos if pos < kv_len else 0
        out.append(pages[p // page_size] * page_size + p % page_size)
    return out


def _gather(
    per_unit: list[list[int]], blocks: int, page_size: int, device: torch.device
) -> KeyGather:
    flat = [i for unit in per_unit for i in unit]
    index = torch.tensor(flat, dtype=torch.int64, device=device)
    return KeyGather(index, len(per_unit), blocks, BLOCK % page_size == 0)


def _block_key(pages: list[int], block: int, page_size: int) -> tuple[int, ...] | None:
    """What identifies a full block's storage, so requests holding the same pages share it."""
    if BLOCK % page_size == 0:
        per = BLOCK // page_size
        return tuple(pages[block * per : (block + 1) * per])
    if page_size % BLOCK == 0:
        pos = block * BLOCK
        return (pages[pos // page_size], pos % page_size)
    return None


def plan_decode(
    tokens: list[int],
    tables: list[list[int]],
    kv_lens: list[int],
    page_size: int,
    device: torch.device,
    min_saved_tokens: int = MIN_SAVED_TOKENS,
) -> DecodePlan:
    """Split a decode group's blocks into shared runs (a trie over block storage) and tails."""
    n = len(tables)
    keys: list[list[tuple[int, ...]]] = []
    for t, kv in zip(tables, kv_lens):
        full = [_block_key(t, b, page_size) for b in range(kv // BLOCK)]
        keys.append([k for k in full if k is not None])
    runs, tail_start = shared_runs(keys, BLOCK, min_saved_tokens)
    shared = []
    for rs, a, b in runs:
        index = [
            i
            for blk in range(a, b)
            for i in _block_index(tables[rs[0]], kv_lens[rs[0]], blk, page_size)
        ]
        members = torch.tensor(rs, dtype=torch.int64, device=device)
        shared.append(SharedRun(members, len(rs), a, _gather([index], b - a, page_size, device)))

    num_blocks = [-(-kv // BLOCK) for kv in kv_lens]
    groups = _group_tails([num_blocks[r] - tail_start[r] for r in range(n)])
    tails = [
        _tail_group(rows, tables, kv_lens, tail_start, num_blocks, page_size, device)
        for rows in groups
    ]
    ends = [tail_start[r] + t.gather.blocks for t, rows in zip(tails, groups) for r in rows]
    ends += [s.first_block + s.gather.blocks for s in shared]
    nb = max(ends)
    for run in shared:
        run.at = _fold_rows(run.members * nb + run.first_block, run.gather.blocks)
    for tail in tails:
        tail.at = _fold_rows(tail.rows * nb + tail.first_block, tail.gather.blocks)
    return DecodePlan(torch.tensor(tokens, dtype=torch.int64, device=device), shared, tails, nb)


def _fold_rows(first: torch.Tensor, blocks: int) -> torch.Tensor:
    """Rows ``first[i] + j`` (j < blocks) of a ``[requests * num_blocks]`` fold, flattened."""
    return (first[:, None] + torch.arange(blocks, device=first.device)[None, :]).reshape(-1)


def _group_tails(tail_blocks: list[int]) -> list[list[int]]:
    """Rows with similar tail lengths batch together (longest first) while padding stays
    under ``MAX_TAIL_PADDING_RATIO``; rows without a tail are left out."""
    order = sorted((r for r, b in enumerate(tail_blocks) if b > 0), key=lambda r: -tail_blocks[r])
    groups: list[list[int]] = []
    total = 0
    for r in order:
        if groups and tail_blocks[groups[-1][0]] * (
            len(groups[-1]) + 1
        ) <= MAX_TAIL_PADDING_RATIO * (total + tail_blocks[r]):
            groups[-1].append(r)
            total += tail_blocks[r]
        else:
            groups.append([r])
            total = tail_blocks[r]
    return groups


def _tail_group(
    rows: list[int],
    tables: list[list[int]],
    kv_lens: list[int],
    tail_start: list[int],
    num_blocks: list[int],
    page_size: int,
    device: torch.device,
) -> TailGroup:
    blocks = max(num_blocks[r] - tail_start[r] for r in rows)
    per_unit = []
    for r in rows:
        per_unit.append(
            [
                i
                for blk in range(tail_start[r], tail_start[r] + blocks)
                for i in _block_index(tables[r], kv_lens[r], blk, page_size)
            ]
        )
    gather = _gather(per_unit, blocks, page_size, device)
    first = torch.tensor([tail_start[r] for r in rows], dtype=torch.int64, device=device)
    key_pos = first[:, None] * BLOCK + torch.arange(blocks * BLOCK, device=device)[None, :]
    query_pos = torch.tensor([kv_lens[r] - 1 for r in rows], dtype=torch.int64, device=device)
    past = key_pos > query_pos[:, None]
    mask = past[:, None, None, :] if bool(past.any()) else None
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    return TailGroup(rows_t, first, gather, mask)


def plan_prefill(
    tokens: tuple[int, int],
    pages: list[int],
    kv_len: int,
    page_size: int,
    group: int,
    padding: RowPadding,
    device: torch.device,
) -> PrefillPlan:
    """Keys and per-tile causal masks of a chunk whose queries each stand for ``group`` rows
    (query heads per KV head); rows are padded as ``padding`` pads them."""
    blocks = -(-kv_len // BLOCK)
    index = [i for blk in range(blocks) for i in _block_index(pages, kv_len, blk, page_size)]
    count = tokens[1] - tokens[0]
    start = kv_len - count
    tiles = []
    for a in range(0, count, PREFILL_TILE_TOKENS):
        b = min(count, a + PREFILL_TILE_TOKENS)
        length = ((start + b - 1) // BLOCK + 1) * BLOCK
        pos = start + a + torch.arange((b - a) * group, device=device) // group
        pos = padding.pad_rows(pos)  # padded rows copy the first query's position
        mask = torch.arange(length, device=device)[None, :] > pos[:, None]
        tiles.append(PrefillTile(a, b, length, mask[None, None]))
    return PrefillPlan(tokens, _gather([index], blocks, page_size, device), tiles)


# ----------------------------------------------------------------------------- the arithmetic


def _scores(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q ``[X, Hkv, R, D]`` (pre-scaled), keys ``[X, L, Hkv, D]`` -> ``[X, Hkv, R, L]``, -inf
    where ``mask``. One product per KV head over strided views: no copy of the keys."""
    x, hkv, r, _ = q.shape
    s = q.new_empty((x, hkv, r, keys.shape[1]))
    for h in range(hkv):
        s[:, h] = torch.matmul(q[:, h], keys[:, :, h].transpose(1, 2))
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    return s


def _partials(
    s: torch.Tensor, row_max: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: ``sum_j exp(s_j - max) v_j`` ``[X, Hkv, NB, R, D]`` and ``sum_j exp(s_j -
    max)`` ``[X, Hkv, NB, R]``, each a reduction over exactly BLOCK keys. Consumes ``s``."""
    x, hkv, r, length = s.shape
    nb = length // BLOCK
    d = values.shape[-1]
    p = s.sub_(row_max).exp_().view(x, hkv, r, nb, BLOCK)
    sums = p.sum(-1).transpose(2, 3)
    pb = p.transpose(2, 3)  # [X, Hkv, NB, R, BLOCK]
    acc = s.new_empty((x, hkv, nb, r, d))
    for h in range(hkv):
        vh = values[:, :, h].view(x, nb, BLOCK, d)
        acc[:, h] = torch.matmul(pb[:, h], vh)
    return acc, sums


def _fold(acc: torch.Tensor, sums: torch.Tensor, dim: int) -> torch.Tensor:
    """Blocks folded in position order along ``dim`` (cumsum: sequential, double precision)."""
    total = acc.cumsum(dim).select(dim, -1)
    return total / sums.cumsum(dim).select(dim, -1).unsqueeze(-1)


def attend_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: DecodePlan,
    padding: RowPadding,
    scale: float,
) -> torch.Tensor:
    """q ``[n, Hkv, G, D]`` float32 -> ``[n, Hkv, G, D]``, for a decode plan."""
    n, hkv, g, d = q.shape
    q = q * scale
    row_max = q.new_full((n, hkv, g), float("-inf"))
    parts: list[tuple[torch.Tensor, SharedRun | TailGroup]] = []

    for run in plan.shared:
        m = run.num_members
        qs = q.index_select(0, run.members).permute(1, 0, 2, 3).reshape(1, hkv, m * g, d)
        qs = padding.pad_rows(qs, dim=2)
        s = _scores(qs, _upcast(run.gather.read(k_pages)), None)
        mx = s.amax(-1)[0, :, : m * g].view(hkv, m, g).transpose(0, 1)
        _max_into(row_max, run.members, mx)
        parts.append((s, run))
    for tail in plan.tails:
        qt = padding.pad_rows(q.index_select(0, tail.rows), dim=2)
        s = _scores(qt, _upcast(tail.gather.read(k_pages)), tail.mask)
        _max_into(row_max, tail.rows, s.amax(-1)[:, :, :g])
        parts.append((s, tail))

    nb = plan.num_blocks
    acc_all = q.new_zeros((n * nb, hkv, g, d))
    sums_all = q.new_zeros((n * nb, hkv, g))
    for s, part in parts:
        # padded rows copy row 0 of their unit: they take its maximum
        if isinstance(part, SharedRun):
            m = part.num_members
            mx = row_max.index_select(0, part.members).transpose(0, 1).reshape(1, hkv, m * g)
            acc, sums = _partials(
                s, padding.pad_rows(mx, dim=2)[..., None], _upcast(part.gather.read(v_pages))
            )
            nbp = part.gather.blocks
            acc = acc[0, :, :, : m * g].reshape(hkv, nbp, m, g, d).permute(2, 1, 0, 3, 4)
            sums = sums[0, :, :, : m * g].reshape(hkv, nbp, m, g).permute(2, 1, 0, 3)
        else:
            mx = row_max.index_select(0, part.rows)
            acc, sums = _partials(
                s, padding.pad_rows(mx, dim=2)[..., None], _upcast(part.gather.read(v_pages))
            )
            acc = acc[:, :, :, :g].permute(0, 2, 1, 3, 4)  # [rows, NB, Hkv, G, D]
            sums = sums[:, :, :, :g].permute(0, 2, 1, 3)
        assert part.at is not None
        acc_all.index_copy_(0, part.at, acc.reshape(-1, hkv, g, d))
        sums_all.index_copy_(0, part.at, sums.reshape(-1, hkv, g))
    out = _fold(acc_all.view(n, nb, hkv, g, d), sums_all.view(n, nb, hkv, g), dim=1)
    return out


def attend_prefill(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: PrefillPlan,
    padding: RowPadding,
    scale: float,
) -> torch.Tensor:
    """q ``[T, Hkv, G, D]`` float32 (the chunk's queries) -> ``[T, Hkv, G, D]``."""
    t, hkv, g, d = q.shape
    keys = _upcast(plan.gather.read(k_pages))
    values = _upcast(plan.gather.read(v_pages))
    q = (q * scale).permute(1, 0, 2, 3)  # [Hkv, T, G, D]
    out = q.new_empty((t, hkv, g, d))
    for tile in plan.tiles:
        a, b, length = tile.a, tile.b, tile.length
        rows = (b - a) * g
        qt = padding.pad_rows(q[:, a:b].reshape(1, hkv, rows, d), dim=2)
        s = _scores(qt, keys[:, :length], tile.mask)
        acc, sums = _partials(s, s.amax(-1, keepdim=True), values[:, :length])
        res = _fold(acc, sums, dim=2)[0, :, :rows]  # [Hkv, rows, D]
        out[a:b] = res.view(hkv, b - a, g, d).transpose(0, 1)
    return out


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _max_into(row_max: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``row_max[rows] = max(row_max[rows], values)``; rows are distinct within one call."""
    row_max.index_copy_(0, rows, torch.maximum(row_max.index_select(0, rows), values))
