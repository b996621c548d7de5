"""The batch-invariant torch backend: ``exact`` plans per pass, attends per layer."""

from __future__ import annotations

import torch

from engine.model.attention import native
from engine.model.attention.base import AttentionBackend
from engine.model.attention.exact import (
    DecodePlan,
    PrefillPlan,
    attend_decode,
    attend_prefill,
    plan_decode,
    plan_prefill,
)
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.rows import RowPadding


class ExactAttentionBackend(AttentionBackend):
    """Paged attention whose output for a query never depends on the batch, the cache or the
    page size. With the native kernel (``engine.model.attention.native``, built on first use) one
    call per layer attends every token; without it, the torch version
    (``engine.model.attention.exact``): decodes form one group (with cascade runs over shared
    blocks), each prefill chunk is attended on its own. The two round differently, so an
    engine uses one of them for its whole life."""

    name = "torch"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        padding: RowPadding,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.padding = padding
        usable = device.type == "cpu" and head_dim % native.HEAD_DIM_MULTIPLE == 0
        self.kernel = native.load_kernel() if usable else None
        self._native: native.NativePlan | None = None
        self._fb: ForwardBatch | None = None
        self._decode: DecodePlan | None = None
        self._prefills: list[PrefillPlan] = []

    @property
    def kernel_name(self) -> str:
        return "native" if self.kernel is not None else "torch"

    def plan(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        dev = fb.input_ids.device
        indptr = fb.kv_indptr.tolist()
        pages = fb.kv_indices.tolist()
        self._fb = fb
        if self.kernel is not None:
            tables = [pages[indptr[b] : indptr[b + 1]] for b in range(fb.batch_size)]
            self._native = native.plan_native(fb.qo_lens, fb.kv_lens, tables, dev)
            return
        starts = [0]
        for n in fb.qo_lens:
            starts.append(starts[-1] + n)
        decodes = [b for b, n in enumerate(fb.qo_lens) if n == 1]
        self._decode = None
        if decodes:
            self._decode = plan_decode(
                [starts[b] for b in decodes],
                [pages[indptr[b] : indptr[b + 1]] for b in decodes],
                [fb.kv_lens[b] for b in decodes],
                fb.page_size,
                dev,
            )
        self._prefills = [
            plan_prefill(
                (starts[b], starts[b + 1]),
                pages[indptr[b] : indptr[b + 1]],
                fb.kv_lens[b],
                fb.page_size,
                self.num_heads // self.num_kv_heads,
                self.padding,
                dev,
            )
            for b, n in enumerate(fb.qo_lens)
            if n > 1
        ]

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        fb = self._fb
        if fb is None:
            raise RuntimeError("ExactAttentionBackend.run called before plan")
        pool.write(layer, fb.slots, k, v)
        k_pages, v_pages = pool.k_cache[layer], pool.v_cache[layer]
        hkv, d = self.num_kv_heads, self.head_dim
        g = self.num_heads // hkv
        scale = d**-0.5
        if self._native is not None:
            qn = q.float().view(-1, hkv * g, d)
            out = native.attend(self.kernel, qn, k_pages, v_pages, self._native, g, scale)
            return out.view(q.shape).to(q.dtype)
        qf = q.float().view(-1, hkv, g, d)
        if self._decode is not None and not self._prefills:  # every token decodes, in order
            out = attend_decode(qf, k_pages, v_pages, self._decode, self.padding, scale)
            return out.view(q.shape).to(q.dtype)
        out = torch.empty_like(qf)
        if self._decode is not None:
            rows = self._decode.tokens
            res = attend_decode(
                qf.index_select(0, rows), k_pages, v_pages, self._decode, self.padding, scale
            )
            out.index_copy_(0, rows, res)
        for p in self._prefills:
            a, b = p.tokens
            out[a:b] = attend_prefill(qf[a:b], k_pages, v_pages, p, self.padding, scale)
        return out.view(q.shape).to(q.dtype)
