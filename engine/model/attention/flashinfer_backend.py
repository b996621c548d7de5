"""Attention by FlashInfer's paged kernels over the radix pages (CUDA), or by its torch reference.

The pool's layout is FlashInfer's NHD layout and a radix page id is a FlashInfer page index,
so the radix tree's page tables go to FlashInfer as they are (``flashinfer_plan``). Per pass:
one ``plan`` of each wrapper in use; per layer: ``append_paged_kv_cache`` for the new tokens,
the own call (the decode wrapper when every request feeds one token, the prefill wrapper
otherwise), and with shared prefixes the shared call and one ``merge_state`` per level.

The calls go to an ``AttentionOps``: FlashInfer itself (imported only when a CUDA engine asks
for it, so CPU installs never need it) or ``flashinfer_reference``, the same calls in plain
torch, which is what runs on the CPU and in CI.

``deterministic``: no cascade (which rows share a call would change the sums), one wrapper
(the prefill kernel) for every pass, and FlashInfer's fixed split size, so that a query's
sums do not depend on how many requests share the pass. Whether that makes a row's output
bit-identical alone and batched is measured on the GPU (``tests/gpu``), not assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.attention.flashinfer_plan import (
    MIN_SAVED_TOKENS,
    FlashInferPlan,
    plan_flashinfer,
)
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
FIXED_SPLIT_PAGES = 64  # KV split size (pages) of deterministic mode


@dataclass
class AttentionOps:
    """The FlashInfer calls the backend makes, from FlashInfer or from its reference."""

    name: str
    prefill_wrapper: Callable[[torch.Tensor], Any]
    decode_wrapper: Callable[[torch.Tensor, bool], Any]  # (workspace, use_tensor_cores)
    append_paged_kv_cache: Callable[..., None]
    merge_state: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def ops_from_module(module: ModuleType, name: str) -> AttentionOps:
    return AttentionOps(
        name,
        lambda ws: module.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD"),
        lambda ws, tensor_cores: module.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=tensor_cores
        ),
        module.append_paged_kv_cache,
        module.merge_state,
    )


def reference_ops() -> AttentionOps:
    from engine.model.attention import flashinfer_reference

    return ops_from_module(flashinfer_reference, "flashinfer-reference")


def flashinfer_ops() -> AttentionOps:
    """FlashInfer's own kernels; ImportError (with the extra to install) where it is missing."""
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            "the flashinfer backend on CUDA needs FlashInfer: pip install -e '.[gpu]'"
        ) from exc
    return ops_from_module(flashinfer, "flashinfer")


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        ops: AttentionOps,
        dtype: torch.dtype = torch.bfloat16,
        cascade: bool = True,
        deterministic: bool = False,
        min_saved_tokens: int = MIN_SAVED_TOKENS,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.ops = ops
        self.dtype = dtype  # of the queries and of the pool: FlashInfer plans for them
        self.deterministic = deterministic
        self.cascade = cascade and not deterministic
        self.min_saved_tokens = min_saved_tokens
        # Wrappers run one after another on one stream, so they share the float workspace.
        size = WORKSPACE_BYTES if device.type == "cuda" else 0
        self._workspace = torch.zeros(size, dtype=torch.uint8, device=device)
        self._prefill = ops.prefill_wrapper(self._workspace)
        # FlashInfer's CUDA-core decode kernel is built for query groups of 1, 2, 3, 4 and 8
        # query heads per KV head; other groups take its tensor-core (prefill) kernel.
        group = num_heads // num_kv_heads
        self._decode = ops.decode_wrapper(self._workspace, group not in (1, 2, 3, 4, 8))
        self._shared = ops.prefill_wrapper(self._workspace)
        self._plan: FlashInferPlan | None = None
        self._own: Any = None

    @property
    def kernel_name(self) -> str:
        return self.ops.name

    @property
    def exact(self) -> bool:
        # Verified bit for bit only where measured (the GPU record); never claimed up front.
        return False

    def plan(self, forward_batch: ForwardBatch) -> None:
        p = plan_flashinfer(forward_batch, self.cascade, self.min_saved_tokens)
        self._plan = p
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        dtypes = {"q_data_type": self.dtype, "kv_data_type": self.dtype}
        split = {"fixed_split_size": FIXED_SPLIT_PAGES} if self.deterministic else {}
        own = p.own
        if p.decode_shaped and not self.deterministic:
            self._decode.plan(
                own.kv_indptr, own.kv_indices, own.kv_last_page_len, hq, hkv, d, p.page_size,
                **dtypes,
            )
            self._own = self._decode
        else:
            self._prefill.plan(
                own.qo_indptr, own.kv_indptr, own.kv_indices, own.kv_last_page_len,
                hq, hkv, d, p.page_size, causal=True, **dtypes, **split,
            )
            self._own = self._prefill
        if p.shared is not None:
            s = p.shared.tables
            self._shared.plan(
                s.qo_indptr, s.kv_indptr, s.kv_indices, s.kv_last_page_len,
                hq, hkv, d, p.page_size, causal=False, **dtypes,
            )

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        p = self._plan
        if p is None:
            raise RuntimeError("FlashInferBackend.run called before plan")
        cache = (pool.k_cache[layer], pool.v_cache[layer])
        full = p.full
        self.ops.append_paged_kv_cache(
            k.contiguous(), v.contiguous(), p.append_batch_indices, p.append_positions, cache,
            full.kv_indices, full.kv_indptr, full.kv_last_page_len,
        )
        q = q.contiguous()
        if p.shared is None:
            return self._own.run(q, cache)
        out, lse = self._own.run(q, cache, return_lse=True)
        s_out, s_lse = self._shared.run(q[p.shared.query_rows], cache, return_lse=True)
        for level in p.shared.levels:
            rows = level.query_rows
            merged, merged_lse = self.ops.merge_state(
                s_out[level.shared_rows], s_lse[level.shared_rows], out[rows], lse[rows]
            )
            out[rows] = merged
            lse[rows] = merged_lse
        return out
