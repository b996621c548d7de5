"""Portable paged attention: one SDPA call per prefill group per layer, decodes in place.

Requests are grouped so that padding stays small (all decodes together; prefill chunks of
similar shape together). Per prefill group, ``plan`` precomputes the token gather indices, the
page table to gather K/V by whole pages and the (offset-causal) mask, so a layer only gathers
and attends. A group of fresh prefills (no cached prefix) attends over its new K/V directly.
The decode group reads K/V as views of the pool (``paged_decode``): no copy of the pages.
Layers with a soft cap or a sliding window (``LayerAttention``) take a plain per-request path
instead: every score written out, capped, masked, softmaxed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.attention.base import AttentionBackend
from engine.model.attention.cascade import CascadePlan, attend_cascade, plan_cascade
from engine.model.attention.paged_decode import DecodePieces, attend_decode, split_into_pieces
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.model_config import LayerAttention

# A prefill group may cost at most this much more than its requests' own q*k areas.
MAX_PADDING_RATIO = 1.3


@dataclass
class _Group:
    """Requests attended together in one SDPA call, padded to [n, max_q, max_k]."""

    q_index: torch.Tensor  # int64 [n, max_q]: rows of the flat q (padding repeats)
    kv_pages: torch.Tensor | None  # int64 [n, max_pages]: pool pages (padding: page 0)
    mask: torch.Tensor | None  # bool [n or 1, 1, max_q, max_k]; None: no mask needed
    is_causal: bool  # top-left causal is exactly right (no prefix, no padding)
    out_rows: torch.Tensor | None  # int64: valid rows of the flattened [n * max_q] output
    out_tokens: torch.Tensor | None  # int64: where those rows go in the flat output
    contiguous_tokens: tuple[int, int] | None  # output is flat tokens [a, b) in order
    fresh: bool  # equal lengths, no cached prefix: K/V are the new tokens themselves
    decode_pieces: list[DecodePieces] | None = None  # one query per request: read in place
    cascade: CascadePlan | None = None  # decode with shared prefixes: each read once


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        layers: Sequence[LayerAttention] | None = None,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, device, layers)
        self._groups: list[_Group] = []
        self._forward_batch: ForwardBatch | None = None
        self._scale = head_dim**-0.5

    def supports(self, attention: LayerAttention) -> bool:
        return True

    def plan(self, forward_batch: ForwardBatch) -> None:
        self._forward_batch = forward_batch
        self._groups = [
            self._plan_group(forward_batch, rows) for rows in _group_requests(forward_batch)
        ]

    def _plan_group(self, fb: ForwardBatch, rows: list[int]) -> _Group:
        dev = fb.input_ids.device
        ps = fb.page_size
        qo = [fb.qo_lens[r] for r in rows]
        kv = [fb.kv_lens[r] for r in rows]
        starts_host = [k - q for q, k in zip(qo, kv)]
        max_q, max_k = max(qo), max(kv)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        qo_t = torch.tensor(qo, dtype=torch.int64, device=dev)
        kv_t = torch.tensor(kv, dtype=torch.int64, device=dev)
        q_start = fb.qo_indptr[rows_t].long()
        page_start = fb.kv_indptr[rows_t].long()

        i = torch.arange(max_q, device=dev)
        q_index = q_start[:, None] + torch.minimum(i[None, :], qo_t[:, None] - 1)
        if max_q == 1:
            return self._plan_decode_group(fb, rows, q_index)

        uniform = len(set(qo)) == 1 and len(set(kv)) == 1
        # fresh: no cached prefix and equal lengths, so the keys are the new tokens themselves
        # and plain top-left causal attention is exact.
        fresh = uniform and starts_host[0] == 0 and max_q > 1
        max_pages = -(-max_k // ps)
        padded_k = max_pages * ps
        n_pages = torch.tensor([-(-k // ps) for k in kv], dtype=torch.int64, device=dev)
        p = torch.arange(max_pages, device=dev)
        page_pos = torch.where(p[None, :] < n_pages[:, None], page_start[:, None] + p[None, :], 0)
        kv_pages = fb.kv_indices.long()[page_pos]  # [n, max_pages]; padding reads page 0

        mask: torch.Tensor | None = None
        if fresh:
            pass  # is_causal below
        elif not (uniform and max_q == 1 and max_k == padded_k):
            # query i of a request (start s, kv length L) sees keys 0..min(s + i, L - 1);
            # padded queries see a harmless non-empty range and are dropped afterwards.
            j = torch.arange(padded_k, device=dev)
            last = torch.minimum((kv_t - qo_t)[:, None] + i[None, :], kv_t[:, None] - 1)
            mask = (j[None, None, :] <= last[:, :, None]).unsqueeze(1)
            if uniform:
                mask = mask[:1]

        contiguous: tuple[int, int] | None = None
        out_rows = out_tokens = None
        if len(set(qo)) == 1 and rows == list(range(rows[0], rows[-1] + 1)):
            a = int(sum(fb.qo_lens[: rows[0]]))
            contiguous = (a, a + sum(qo))
        else:
            valid_q = (i[None, :] < qo_t[:, None]).reshape(-1)
            out_rows = torch.nonzero(valid_q).squeeze(1)
            out_tokens = (q_start[:, None] + i[None, :]).reshape(-1)[out_rows]
        return _Group(q_index, kv_pages, mask, fresh, out_rows, out_tokens, contiguous, fresh)

    def _plan_decode_group(
        self, fb: ForwardBatch, rows: list[int], q_index: torch.Tensor
    ) -> _Group:
        """One query per request: the pool pieces each request reads (no mask, no padding), or
        a cascade plan when requests share prefix pages."""
        indptr = fb.kv_indptr.tolist()
        kv_lens = [fb.kv_lens[r] for r in rows]
        all_pages = fb.kv_indices.tolist()
        tables = [all_pages[indptr[r] : indptr[r + 1]] for r in rows]
        cascade = plan_cascade(tables, kv_lens, fb.page_size, device=q_index.device)
        pieces: list[DecodePieces] | None = None
        if cascade is None:
            if len(rows) == fb.batch_size:
                pages = fb.kv_indices
            else:
                pages = torch.cat([fb.kv_indices[indptr[r] : indptr[r + 1]] for r in rows])
            pieces = split_into_pieces(pages, [len(t) for t in tables], kv_lens, fb.page_size)
        contiguous: tuple[int, int] | None = None
        out_rows = out_tokens = None
        if rows == list(range(rows[0], rows[-1] + 1)):
            a = sum(fb.qo_lens[: rows[0]])
            contiguous = (a, a + len(rows))
        else:
            out_rows = torch.arange(len(rows), device=q_index.device)
            out_tokens = q_index[:, 0]
        return _Group(
            q_index, None, None, False, out_rows, out_tokens, contiguous, False, pieces, cascade
        )

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        fb = self._forward_batch
        if fb is None:
            raise RuntimeError("TorchAttentionBackend.run called before plan")
        slots, kv_indices = fb.slots, fb.kv_indices
        if pool.is_window(layer):
            index = self.window_index(pool, fb)
            slots, kv_indices = index.slots, index.kv_indices
        pool.store(layer, slots, k, v)
        k_pages, v_pages = pool.k_cache[layer], pool.v_cache[layer]
        spec = self.layer(layer)
        if spec.softcap or spec.window:
            return self._attend_variant(fb, spec, q, k_pages, v_pages, kv_indices)
        self._scale = spec.scale
        if len(self._groups) == 1 and self._groups[0].contiguous_tokens is not None:
            return self._attend(self._groups[0], q, k, v, k_pages, v_pages).reshape(q.shape)
        out = torch.empty_like(q)
        for g in self._groups:
            res = self._attend(g, q, k, v, k_pages, v_pages)
            if g.contiguous_tokens is not None:
                a, b = g.contiguous_tokens
                out[a:b] = res.reshape(b - a, self.num_heads, self.head_dim)
            else:
                flat = res.reshape(-1, self.num_heads, self.head_dim)
                out.index_copy_(0, g.out_tokens, flat.index_select(0, g.out_rows))
        return out

    def _attend(
        self,
        g: _Group,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
    ) -> torch.Tensor:
        """SDPA for one group; returns ``[n, max_q, num_heads, head_dim]``."""
        n, max_q = g.q_index.shape
        if g.decode_pieces is not None or g.cascade is not None:
            return self._attend_decode(g, q, k_pages, v_pages)
        if g.contiguous_tokens is not None:  # no gather: a view of the flat tokens
            a, b = g.contiguous_tokens
            qg = q[a:b].view(n, max_q, self.num_heads, self.head_dim).transpose(1, 2)
        else:
            qg = q[g.q_index].transpose(1, 2)  # [n, Hq, max_q, D]
        if g.fresh:  # the pool holds exactly these K/V: skip reading them back
            if g.contiguous_tokens is not None:
                a, b = g.contiguous_tokens
                kg = k[a:b].view(n, max_q, self.num_kv_heads, self.head_dim)
                vg = v[a:b].view(n, max_q, self.num_kv_heads, self.head_dim)
            else:
                kg, vg = k[g.q_index], v[g.q_index]
        else:  # whole pages: [n, max_pages, page_size, Hkv, D] -> [n, max_pages * page_size, Hkv, D]
            shape = (n, -1, self.num_kv_heads, self.head_dim)
            kg, vg = k_pages[g.kv_pages].view(shape), v_pages[g.kv_pages].view(shape)
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
        if kg.dtype != qg.dtype:
            kg, vg = kg.to(qg.dtype), vg.to(qg.dtype)
        out = F.scaled_dot_product_attention(
            qg,
            kg,
            vg,
            attn_mask=g.mask,
            is_causal=g.is_causal,
            enable_gqa=self.num_heads != self.num_kv_heads,
            scale=self._scale,
        )
        return out.transpose(1, 2)

    def _attend_decode(
        self, g: _Group, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor
    ) -> torch.Tensor:
        """One query per request, read from pool views: the query heads sharing a KV head form
        one ``[rep, D]`` block, so each KV head is read once per request."""
        n = g.q_index.shape[0]
        rep = self.num_heads // self.num_kv_heads
        if g.contiguous_tokens is not None:
            a, b = g.contiguous_tokens
            qg = q[a:b].reshape(n, self.num_kv_heads, rep, self.head_dim)
        else:
            qg = q[g.q_index[:, 0]].reshape(n, self.num_kv_heads, rep, self.head_dim)
        kv_shape = (-1, self.num_kv_heads, self.head_dim)
        k_flat, v_flat = k_pages.view(kv_shape), v_pages.view(kv_shape)
        scale = self._scale
        if g.cascade is not None:
            out = attend_cascade(qg, k_flat, v_flat, g.cascade, scale)
        else:
            assert g.decode_pieces is not None
            out = attend_decode(qg, k_flat, v_flat, g.decode_pieces, scale)
        return out.reshape(n, 1, self.num_heads, self.head_dim)


    def _attend_variant(
        self,
        fb: ForwardBatch,
        spec: LayerAttention,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        kv_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Request by request: scores by ``spec.scale``, capped, masked to the causal window,
        softmax in float32, then the values. ``kv_indices``: the pages in ``k_pages``' ids
        (``fb.kv_indices``, or their window slots)."""
        out = torch.empty_like(q)
        indptr = fb.kv_indptr.tolist()
        qo_ptr = fb.qo_indptr.tolist()
        hkv, d = self.num_kv_heads, self.head_dim
        rep = self.num_heads // hkv
        for r in range(fb.batch_size):
            n_q, n_k = fb.qo_lens[r], fb.kv_lens[r]
            a = qo_ptr[r]
            pages = kv_indices[indptr[r] : indptr[r + 1]].long()
            keys = k_pages[pages].reshape(-1, hkv, d)[:n_k].float()
            values = v_pages[pages].reshape(-1, hkv, d)[:n_k].float()
            qs = q[a : a + n_q].float().view(n_q, hkv, rep, d)
            scores = torch.einsum("qhgd,khd->hgqk", qs, keys) * spec.scale
            if spec.softcap:
                scores = torch.tanh(scores / spec.softcap) * spec.softcap
            pos = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
            key = torch.arange(n_k, device=q.device)[None, :]
            allowed = key <= pos
            if spec.window:
                allowed &= key > pos - spec.window
            scores = scores.masked_fill(~allowed, float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            res = torch.einsum("hgqk,khd->qhgd", weights, values)
            out[a : a + n_q] = res.reshape(n_q, self.num_heads, d).to(out.dtype)
        return out


def _group_requests(fb: ForwardBatch) -> list[list[int]]:
    """Decodes form one group; prefill chunks group while padding stays under the ratio."""
    decodes = [b for b, n in enumerate(fb.qo_lens) if n == 1]
    prefills = sorted(
        (b for b, n in enumerate(fb.qo_lens) if n > 1), key=lambda b: (-fb.qo_lens[b], b)
    )
    groups: list[list[int]] = []
    if decodes:
        groups.append(decodes)
    current: list[int] = []
    area = 0
    for b in prefills:
        q, k = fb.qo_lens[b], fb.kv_lens[b]
        if current:
            cand = current + [b]
            padded = len(cand) * max(fb.qo_lens[r] for r in cand) * max(fb.kv_lens[r] for r in cand)
            if padded <= MAX_PADDING_RATIO * (area + q * k):
                current.append(b)
                area += q * k
                continue
            groups.append(sorted(current))
        current, area = [b], q * k
    if current:
        groups.append(sorted(current))
    return groups
