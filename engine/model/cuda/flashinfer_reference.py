"""FlashInfer's paged-attention calls as plain torch, with FlashInfer's documented semantics.

The FlashInfer backend (``flashinfer_backend``) drives FlashInfer through four things: the
batch prefill and batch decode wrappers (``plan`` once per pass, ``run`` per layer),
``append_paged_kv_cache`` and ``merge_state``. This module implements the same calls, same
arguments, on any device, one request at a time and in float32, so that the backend's planning
and merging run in CI on the CPU and are tested against the engine's own attention. It is a
reference, not a kernel: slow, and never picked for speed.

Semantics followed (FlashInfer 0.6, ``docs.flashinfer.ai``): NHD pages ``[num_pages, page_size,
num_kv_heads, head_dim]``; request ``b`` owns queries ``qo_indptr[b]:qo_indptr[b+1]`` and pages
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, its KV length is ``(pages - 1) * page_size +
kv_last_page_len[b]`` (0 without pages); with ``causal`` the diagonal is aligned to the end of
the KV (query ``i`` of ``n`` sees keys ``0 .. kv_len - n + i``); the log-sum-exp is base 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG2E = 1.0 / math.log(2.0)
ROW_BLOCK = 16  # query rows per product: one shape for every pass


def _kv_len(num_pages: int, last_page_len: int, page_size: int) -> int:
    return 0 if num_pages == 0 else (num_pages - 1) * page_size + last_page_len


def _attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[n, Hq, D]``, k/v ``[L, Hkv, D]`` -> out ``[n, Hq, D]`` float32, lse ``[n, Hq]`` (base 2).

    Batch-invariant, so that the engine's invariance checks can run on the reference: with
    ``causal`` a query at position ``p`` (queries are the last ``n`` tokens) is computed in
    the block of ``ROW_BLOCK`` positions holding ``p``, over exactly the keys up to that
    block's end (zeros past the KV, all masked beyond ``p``), so every product and every
    sum has a shape fixed by ``p`` alone, whatever the chunk or the batch."""
    n, hq, d = q.shape
    kv_len, hkv = k.shape[0], k.shape[1]
    if kv_len == 0:
        return q.new_zeros((n, hq, d), dtype=torch.float32), torch.full(
            (n, hq), float("-inf"), dtype=torch.float32, device=q.device
        )
    group = hq // hkv
    kf = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    out = torch.empty((n, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, hq), dtype=torch.float32, device=q.device)
    first = kv_len - n  # position of query 0
    if causal:
        blocks = range(first // ROW_BLOCK, (kv_len - 1) // ROW_BLOCK + 1)
    else:
        blocks = range(-(-n // ROW_BLOCK))
    for block in blocks:
        if causal:
            lo = max(block * ROW_BLOCK, first)  # positions of this block's queries
            hi = min((block + 1) * ROW_BLOCK, kv_len)
            rows = slice(lo - first, hi - first)
            keys = (block + 1) * ROW_BLOCK
            positions = torch.arange(lo, lo + ROW_BLOCK, device=q.device)
        else:
            rows = slice(block * ROW_BLOCK, min((block + 1) * ROW_BLOCK, n))
            keys = kv_len
        count = rows.stop - rows.start
        qb = q[rows].float()
        if count < ROW_BLOCK:
            qb = torch.cat([qb, qb.new_zeros(ROW_BLOCK - count, hq, d)])
        kb, vb = kf[:keys], vf[:keys]
        if keys > kv_len:
            pad = kf.new_zeros(keys - kv_len, hq, d)
            kb, vb = torch.cat([kb, pad]), torch.cat([vb, pad])
        scores = torch.einsum("nhd,lhd->hnl", qb, kb) * sm_scale
        if causal:
            hidden = torch.arange(keys, device=q.device)[None, :] > positions[:, None]
            scores = scores.masked_fill(hidden[None], float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)  # [Hq, ROW_BLOCK], natural log
        block_out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), vb)
        out[rows] = block_out[:count]
        lse[rows] = (block_lse * LOG2E).transpose(0, 1)[:count]
    return out, lse


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """A request's tokens ``[kv_len, H, D]`` from its pages of an NHD cache."""
    return cache[pages.long()].flatten(0, 1)[:kv_len]


@dataclass
class _Planned:
    """A plan as host lists: per entry its query rows, pages and last page's length."""

    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: torch.Tensor
    last_page_len: list[int]
    page_size: int
    causal: bool
    sm_scale: float


class _PagedAttention:
    """What both wrappers share: the planned page tables, and one request at a time."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_tensor_cores: bool = False,
        use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_last_page_len: torch.Tensor | None = None,
    ) -> None:
        if kv_layout != "NHD":
            raise ValueError(f"kv_layout: the reference implements NHD only, got {kv_layout!r}")
        self._planned: _Planned | None = None
        # CUDA-graph mode: ``plan`` copies the tables into these fixed buffers and ``run``
        # reads them there, as the captured kernels do at replay.
        self._graph: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor] | None
        self._graph = None
        if use_cuda_graph:
            if kv_indptr is None or kv_indices is None or kv_last_page_len is None:
                raise ValueError("use_cuda_graph: the index buffers are required")
            if len(kv_indptr) != len(kv_last_page_len) + 1:
                raise ValueError("kv_indptr: its length must be the batch size + 1")
            self._graph = (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        # CUDA-graph mode: FlashInfer's prefill wrapper keeps its first plan's query rows as
        # the most any later plan may have (it sizes the captured grid from them).
        self._max_rows: int | None = None

    def _plan(
        self,
        qo_indptr: torch.Tensor | None,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool,
        sm_scale: float | None,
    ) -> None:
        """``qo_indptr`` None: one query per entry (the decode wrapper)."""
        for name, t in (
            ("kv_indptr", kv_indptr),
            ("kv_indices", kv_indices),
            ("kv_last_page_len", kv_last_page_len),
        ):
            if t.dtype != torch.int32:
                raise ValueError(f"{name}: must be int32 (FlashInfer's index type), got {t.dtype}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(
                f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        if self._graph is not None:
            qo_buf, kv_buf, indices_buf, last_buf = self._graph
            if len(kv_indptr) != len(kv_buf):
                raise ValueError(
                    f"batch size: {len(kv_indptr) - 1} in a CUDA-graph wrapper of {len(kv_buf) - 1}"
                )
            if len(kv_indices) > len(indices_buf):
                raise ValueError("kv_indices: longer than the CUDA-graph buffer")
            if qo_buf is not None and qo_indptr is not None:
                rows = int(qo_indptr[-1])
                if self._max_rows is None:
                    self._max_rows = rows
                elif rows > self._max_rows:
                    raise ValueError(
                        f"qo_indptr: {rows} rows in a CUDA-graph wrapper first planned with "
                        f"{self._max_rows}"
                    )
                qo_buf.copy_(qo_indptr)
            kv_buf.copy_(kv_indptr)
            indices_buf[: len(kv_indices)].copy_(kv_indices)
            last_buf.copy_(kv_last_page_len)
        kv = kv_indptr.tolist()
        self._planned = _Planned(
            list(range(len(kv))) if qo_indptr is None else qo_indptr.tolist(),
            kv,
            kv_indices,
            kv_last_page_len.tolist(),
            page_size,
            causal,
            head_dim**-0.5 if sm_scale is None else sm_scale,
        )

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
        *,  # keyword-only in FlashInfer's run (after its *args)
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q`` over the planned pages; with ``return_lse`` also the base-2
        log-sum-exp ``[tokens, heads]`` (float32)."""
        p = self._planned
        if p is None:
            raise RuntimeError("run called before plan")
        if self._graph is not None:  # what the buffers hold now, not what was planned
            qo_buf, kv_buf, indices_buf, last_buf = self._graph
            kv = kv_buf.tolist()
            qo = list(range(len(kv))) if qo_buf is None else qo_buf.tolist()
            p = _Planned(qo, kv, indices_buf[: kv[-1]], last_buf.tolist(), p.page_size,
                         p.causal, p.sm_scale)
        k_cache, v_cache = paged_kv_cache
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for b in range(len(p.kv_indptr) - 1):
            qa, qb = p.qo_indptr[b], p.qo_indptr[b + 1]
            pa, pb = p.kv_indptr[b], p.kv_indptr[b + 1]
            kv_len = _kv_len(pb - pa, p.last_page_len[b], p.page_size)
            pages = p.kv_indices[pa:pb]
            out[qa:qb], lse[qa:qb] = _attend_one(
                q[qa:qb],
                _gather_pages(k_cache, pages, kv_len),
                _gather_pages(v_cache, pages, kv_len),
                p.causal,
                p.sm_scale,
            )
        result = out.to(q.dtype)
        return (result, lse) if return_lse else result


class BatchPrefillWithPagedKVCacheWrapper(_PagedAttention):
    """``flashinfer.BatchPrefillWithPagedKVCacheWrapper``: queries of any length per request."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
    ) -> None:
        if use_cuda_graph and qo_indptr_buf is None:
            raise ValueError("qo_indptr_buf: required in CUDA-graph mode")
        super().__init__(
            float_workspace_buffer, kv_layout, False, use_cuda_graph, qo_indptr_buf,
            paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf,
        )

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        *,  # FlashInfer's next positional is head_dim_vo: pass the rest by name, as we do
        causal: bool = False,
        sm_scale: float | None = None,
        q_data_type: torch.dtype | None = None,
        kv_data_type: torch.dtype | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        if qo_indptr.dtype != torch.int32:
            raise ValueError(f"qo_indptr: must be int32, got {qo_indptr.dtype}")
        self._plan(
            qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
        )


class BatchDecodeWithPagedKVCacheWrapper(_PagedAttention):
    """``flashinfer.BatchDecodeWithPagedKVCacheWrapper``: one query per request, every key."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            float_workspace_buffer, kv_layout, use_tensor_cores, use_cuda_graph, None,
            paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer,
        )

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,  # FlashInfer's next positional is pos_encoding_mode: pass the rest by name
        sm_scale: float | None = None,
        q_data_type: torch.dtype | None = None,
        kv_data_type: torch.dtype | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        # One query at the end of its KV: causal is every key, and computed as the prefill
        # wrapper computes a last row (FlashInfer's two kernels need not agree; this does).
        self._plan(
            None, indptr, indices, last_page_len,
            num_qo_heads, num_kv_heads, head_dim, page_size, True, sm_scale,
        )


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    """``flashinfer.append_paged_kv_cache``: token ``i`` of request ``batch_indices[i]`` goes to
    position ``positions[i]`` of that request's pages (the page tables after the append)."""
    if kv_layout != "NHD":
        raise ValueError(f"kv_layout: the reference implements NHD only, got {kv_layout!r}")
    k_cache, v_cache = paged_kv_cache
    ps = k_cache.shape[1]
    b = batch_indices.long()
    pos = positions.long()
    page = kv_indices.long()[kv_indptr.long()[b] + pos // ps]
    slot = page * ps + pos % ps
    k_cache.view(-1, *k_cache.shape[2:])[slot] = append_key.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot] = append_value.to(v_cache.dtype)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashinfer.merge_state``: attention over keys A and over keys B (outputs ``[n, H, D]``,
    base-2 log-sum-exps ``[n, H]``) -> attention over A and B together."""
    s_max = torch.maximum(s_a, s_b)
    w_a = torch.exp2(s_a - s_max)
    w_b = torch.exp2(s_b - s_max)
    total = w_a + w_b
    v = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / total[..., None]
    return v.to(v_a.dtype), s_max + torch.log2(total)
