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
(the prefill kernel, tensor cores) for every pass, decode-only passes included, and no KV
split (``disable_split_kv``: one work unit per query tile and head over the whole KV), so a
query's sums do not depend on how many requests share the pass, nor on whether it runs in a
decode graph or an eager pass (a fixed split size would do for eager passes, but FlashInfer's
FA2 scheduler cannot fit it into a graph's fixed grid, and a graph row must equal an eager
one). On Hopper FlashInfer's FA3 prefill never splits KV anyway. Whether a row is then
bit-identical alone and batched is verified on the device at start (``device_check``).

``graph_batch``: the wrappers run in FlashInfer's CUDA-graph mode for exactly that many
entries, over index buffers of their own that ``plan`` fills (on the host side, before each
replay; the captured kernels read them), with room for ``graph_pages`` pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.cuda.cascade_rule import CascadeCosts, cascade_pays
from engine.model.cuda.flashinfer_plan import (
    MIN_SAVED_TOKENS,
    CascadeTest,
    FlashInferPlan,
    plan_flashinfer,
)
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
# The KV split of deterministic mode: none, in eager passes and graphs alike (see above).
DETERMINISTIC_SPLIT: dict[str, Any] = {"disable_split_kv": True}


@dataclass
class AttentionOps:
    """The FlashInfer calls the backend makes, from FlashInfer or from its reference."""

    name: str
    # (workspace, graph buffers or None); in graph mode the buffers are the wrapper's own
    prefill_wrapper: Callable[[torch.Tensor, GraphBuffers | None], Any]
    # (workspace, use_tensor_cores, graph buffers or None)
    decode_wrapper: Callable[[torch.Tensor, bool, GraphBuffers | None], Any]
    append_paged_kv_cache: Callable[..., None]
    merge_state: Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class GraphBuffers:
    """A CUDA-graph wrapper's fixed index buffers (int32, on the device): ``batch`` entries,
    up to ``len(kv_indices)`` pages."""

    qo_indptr: torch.Tensor  # [batch + 1]
    kv_indptr: torch.Tensor  # [batch + 1]
    kv_indices: torch.Tensor  # [max pages]
    kv_last_page_len: torch.Tensor  # [batch]

    @classmethod
    def empty(cls, batch: int, pages: int, device: torch.device) -> GraphBuffers:
        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        return cls(i32(batch + 1), i32(batch + 1), i32(pages), i32(batch))


def _graph_kwargs(buffers: GraphBuffers | None, prefill: bool) -> dict[str, Any]:
    if buffers is None:
        return {}
    kwargs = {
        "use_cuda_graph": True,
        "paged_kv_indptr_buffer" if not prefill else "paged_kv_indptr_buf": buffers.kv_indptr,
        "paged_kv_indices_buffer" if not prefill else "paged_kv_indices_buf": buffers.kv_indices,
        "paged_kv_last_page_len_buffer" if not prefill else "paged_kv_last_page_len_buf":
            buffers.kv_last_page_len,
    }
    if prefill:
        kwargs["qo_indptr_buf"] = buffers.qo_indptr
    return kwargs


def ops_from_module(module: ModuleType, name: str) -> AttentionOps:
    return AttentionOps(
        name,
        lambda ws, graph: module.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", **_graph_kwargs(graph, prefill=True)
        ),
        lambda ws, tensor_cores, graph: module.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=tensor_cores, **_graph_kwargs(graph, prefill=False)
        ),
        module.append_paged_kv_cache,
        module.merge_state,
    )


def reference_ops() -> AttentionOps:
    from engine.model.cuda import flashinfer_reference

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
        cascade_costs: CascadeCosts | None = None,
        workspace: torch.Tensor | None = None,
        graph_batch: int | None = None,
        graph_pages: int = 0,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.ops = ops
        self.dtype = dtype  # of the queries and of the pool: FlashInfer plans for them
        self.deterministic = deterministic
        self.graph_batch = graph_batch
        # A graph runs one fixed call per layer: no shared call to merge.
        self.cascade = cascade and not deterministic and graph_batch is None
        self.min_saved_tokens = min_saved_tokens
        # None: every shared run worth min_saved_tokens is cascaded (the CPU reference's tests)
        self._pays: CascadeTest | None = None
        if cascade_costs is not None:
            token_bytes = 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
            self._pays = partial(
                cascade_pays, kv_heads=num_kv_heads, group=num_heads // num_kv_heads,
                bytes_per_token=token_bytes, costs=cascade_costs,
            )
        # Wrappers run one after another on one stream, so they share the float workspace
        # (zeroed once: FlashInfer reads stale split-KV partials from a dirty one).
        if workspace is None:
            size = WORKSPACE_BYTES if device.type == "cuda" else 0
            workspace = torch.zeros(size, dtype=torch.uint8, device=device)
        self.workspace = workspace
        graph = None
        if graph_batch is not None:
            graph = GraphBuffers.empty(graph_batch, graph_pages, device)
        self._prefill = ops.prefill_wrapper(workspace, graph)
        # FlashInfer's CUDA-core decode kernel is built for query groups of 1, 2, 3, 4 and 8
        # query heads per KV head; other groups take its tensor-core (prefill) kernel.
        group = num_heads // num_kv_heads
        self._decode = None
        if not deterministic:
            self._decode = ops.decode_wrapper(workspace, group not in (1, 2, 3, 4, 8), graph)
        self._shared = ops.prefill_wrapper(workspace, None) if self.cascade else None
        self._plan: FlashInferPlan | None = None
        self._own: Any = None
        # The last plan's completion on the stream: FlashInfer's ``plan`` writes each wrapper's
        # schedule into one pinned host buffer and copies it to the device asynchronously, so
        # the next ``plan`` must not rewrite that buffer before the copy has read it.
        self._planned: torch.cuda.Event | None = None
        self._graph_decode: bool | None = None  # graph mode: the wrapper planned (first pass)

    def for_graph(self, batch: int, pages: int) -> FlashInferBackend:
        """This backend's settings in CUDA-graph mode for ``batch`` entries and up to
        ``pages`` pages, sharing its workspace (graphs replay one at a time)."""
        return FlashInferBackend(
            self.num_heads, self.num_kv_heads, self.head_dim, self.device, self.ops, self.dtype,
            cascade=False, deterministic=self.deterministic, workspace=self.workspace,
            graph_batch=batch, graph_pages=pages,
        )

    @property
    def kernel_name(self) -> str:
        return self.ops.name

    @property
    def exact(self) -> bool:
        # Claimed by the deterministic plan; the engine verifies it on the device at start
        # (``device_check``) and reports what it found.
        return self.deterministic

    def plan(self, forward_batch: ForwardBatch) -> None:
        p = plan_flashinfer(forward_batch, self.cascade, self.min_saved_tokens, self._pays)
        if self._planned is not None:
            self._planned.synchronize()  # at once, unless the device is a whole pass behind
        self._plan = p
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        dtypes = {"q_data_type": self.dtype, "kv_data_type": self.dtype}
        split = DETERMINISTIC_SPLIT if self.deterministic else {}
        own = p.own
        if self.graph_batch is None:
            use_decode = p.decode_shaped and self._decode is not None
        else:
            use_decode = self._graph_uses_decode(forward_batch)
        if use_decode:
            assert self._decode is not None
            self._decode.plan(
                own.plan_kv_indptr, own.kv_indices, own.plan_kv_last_page_len, hq, hkv, d,
                p.page_size, **dtypes,
            )
            self._own = self._decode
        else:
            self._prefill.plan(
                own.plan_qo_indptr, own.plan_kv_indptr, own.kv_indices,
                own.plan_kv_last_page_len, hq, hkv, d, p.page_size, causal=True, **dtypes,
                **split,
            )
            self._own = self._prefill
        if p.shared is not None:
            assert self._shared is not None
            s = p.shared.tables
            self._shared.plan(
                s.plan_qo_indptr, s.plan_kv_indptr, s.kv_indices, s.plan_kv_last_page_len,
                hq, hkv, d, p.page_size, causal=False, **dtypes,
            )
        if self.workspace.device.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()

    def _graph_uses_decode(self, forward_batch: ForwardBatch) -> bool:
        """A graph replays the wrapper it captured, whatever a later pass's shape: its
        all-padding capture pass (entries of one key) is not ``decode_shaped`` and a full
        bucket of decodes is, so choosing by the pass would plan the other wrapper and leave
        the captured one's buffers and schedule stale. The first pass (the capture's) decides:
        the decode wrapper where there is one and every entry has one query."""
        one_query = all(n == 1 for n in forward_batch.qo_lens)
        if self._graph_decode is None:
            self._graph_decode = self._decode is not None and one_query
        elif self._graph_decode and not one_query:
            raise ValueError("graph_batch: a pass with several queries per entry in a graph "
                             "captured with FlashInfer's decode wrapper")
        return self._graph_decode

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
        assert self._shared is not None
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
