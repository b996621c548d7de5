"""The batch-invariant attention backend: the native kernel, one call per layer.

A query's output never depends on the batch, the cache or the page size: each query row is
computed by one fixed sequence of instructions over its own keys, whatever shares the call
(``csrc/exact_attention.cpp``). Where the kernel cannot be built the engine runs the fast
backend, and the dtype probe's check on the real forward reports that passes are then not
verified invariant (``engine.model.bringup.dtype_probe``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.cpu import exact_attention
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.rope import Rope


class ExactAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        kernel: ModuleType,
        threads: int = 1,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.kernel = kernel
        self.threads = threads  # every pass's attention runs on this many threads
        self._native: exact_attention.NativePlan | None = None
        self._fb: ForwardBatch | None = None

    @property
    def kernel_name(self) -> str:
        return "native"

    @property
    def exact(self) -> bool:
        return True

    def plan(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        indptr = fb.kv_indptr.tolist()
        pages = fb.kv_indices.tolist()
        self._fb = fb
        tables = [pages[indptr[b] : indptr[b + 1]] for b in range(fb.batch_size)]
        self._native = exact_attention.plan_native(
            fb.qo_lens, fb.kv_lens, tables, fb.input_ids.device
        )

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        fb, plan = self._fb, self._native
        if fb is None or plan is None:
            raise RuntimeError("ExactAttentionBackend.run called before plan")
        pool.write(layer, fb.slots, k, v)
        hkv, d = self.num_kv_heads, self.head_dim
        g = self.num_heads // hkv
        qn = q.float().view(-1, hkv * g, d)
        out = exact_attention.attend(
            self.kernel, qn, pool.k_cache[layer], pool.v_cache[layer], plan, g, d**-0.5,
            self.threads,
        )
        return out.view(q.shape).to(q.dtype)

    def run_qkv(self, layer: int, qkv: torch.Tensor, rope: Rope, pool: KVPool) -> torch.Tensor:
        """RoPE, the K/V write and attention in one native call (float32 rows from our
        products; other rows take the unfused path)."""
        fb, plan = self._fb, self._native
        if fb is None or plan is None:
            raise RuntimeError("ExactAttentionBackend.run_qkv called before plan")
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1:
            return super().run_qkv(layer, qkv, rope, pool)
        hkv, d = self.num_kv_heads, self.head_dim
        cos, sin = rope  # [T, 1, D/2] float32 and contiguous: the kernel reads them as [T, D/2]
        out = exact_attention.rope_write_attend(
            self.kernel, qkv, cos, sin, fb.slots, pool.k_cache[layer], pool.v_cache[layer],
            plan, self.num_heads // hkv, d**-0.5, self.threads,
        )
        return out.view(-1, self.num_heads * d)
