"""The CPU's batch-invariant attention: the kernel in C++ (``csrc/exact_attention.cpp``),
built per machine, and the attention backend over it (``ExactAttentionBackend``).

A query's output never depends on the batch, the cache or the page size: each query row is
computed by one fixed sequence of instructions over its own keys, whatever shares the call
(see the source's header). The kernel is compiled on first use for this machine
(``engine.model.cpu.native_build``); when it cannot be built, or fails its self-test (a bad
slot or page id must be a RuntimeError here), the engine keeps torch's attention and says so
once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.cpu.native_build import expect_rejection, load_native
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.model_config import LayerAttention
from engine.model.rope import Rope

SOURCE = Path(__file__).parent / "csrc" / "exact_attention.cpp"
# Prefill queries of one request are attended in items of this many tokens; decode queries
# (one per request) in items of up to DECODE_ITEM_TOKENS requests with similar page tables.
PREFILL_ITEM_TOKENS = 32
DECODE_ITEM_TOKENS = 8
HEAD_DIM_MULTIPLE = 32  # the kernel's register tiles
DISABLE_ENV = "RADIXKV_NATIVE_ATTENTION"  # "0" keeps the torch version
SELF_TEST = "engine.model.cpu.exact_attention:rejects_bad_slots_and_pages"


def load_kernel() -> ModuleType | None:
    """The compiled module (built on first use), or None where it cannot be built here."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    return load_native(
        SOURCE, "radixkv_exact", "using the torch version of exact attention", selftest=SELF_TEST
    )


def rejects_bad_slots_and_pages(kernel: ModuleType) -> str | None:
    """The build's self-test (``native_build.self_test``): a slot past the pool (the call that
    killed the process on one Xeon, issue 47) and a page id past it, on as many threads as
    the machine has cores, must each raise RuntimeError. None where they did, else what
    happened."""
    cpu = torch.device("cpu")
    pool = torch.zeros(1, 16, 1, HEAD_DIM_MULTIPLE)
    qkv = torch.zeros(1, 3 * HEAD_DIM_MULTIPLE)
    half = torch.zeros(1, HEAD_DIM_MULTIPLE // 2)
    good, bad = plan_native([1], [1], [[0]], cpu), plan_native([1], [1], [[1]], cpu)
    threads = max(2, min(os.cpu_count() or 1, 64))
    return expect_rejection(
        lambda: rope_write_attend(
            kernel, qkv, half, half, torch.tensor([16]), pool, pool.clone(), good, 1, 1.0, threads
        ),
        "slots",
    ) or expect_rejection(
        lambda: attend(kernel, qkv[:, :32].view(1, 1, 32), pool, pool, bad, 1, 1.0, threads),
        "tables",
    )


@dataclass
class NativePlan:
    """Index tensors of one pass for the kernel (int32): each token's request and position,
    and work items (tokens that share key gathers)."""

    tables: torch.Tensor  # [requests, max pages]
    table_lens: torch.Tensor  # [requests]
    q_seq: torch.Tensor  # [T]
    q_pos: torch.Tensor  # [T]: the query attends keys 0..pos
    order: torch.Tensor  # [T]: tokens in item order
    item_ptr: torch.Tensor  # [items + 1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The plan as the kernel's calls take it, in their order."""
        return (self.tables, self.table_lens, self.q_seq, self.q_pos, self.order, self.item_ptr)


def plan_native(
    qo_lens: list[int], kv_lens: list[int], tables: list[list[int]], device: torch.device
) -> NativePlan:
    """Items for a pass: prefill chunks in tiles of PREFILL_ITEM_TOKENS, decodes sorted by
    page table (so requests sharing a prefix share its gathers) in groups; costliest first."""
    q_seq: list[int] = []
    q_pos: list[int] = []
    items: list[tuple[int, list[int]]] = []  # (cost, tokens)
    decodes: list[tuple[int, int]] = []  # (request, its token)
    for r, (n, kv) in enumerate(zip(qo_lens, kv_lens)):
        first = len(q_seq)
        q_seq.extend([r] * n)
        q_pos.extend(range(kv - n, kv))
        if n == 1:
            decodes.append((r, first))
            continue
        for a in range(0, n, PREFILL_ITEM_TOKENS):
            b = min(n, a + PREFILL_ITEM_TOKENS)
            items.append(((b - a) * (kv - n + b), list(range(first + a, first + b))))
    decodes.sort(key=lambda d: tables[d[0]])
    for a in range(0, len(decodes), DECODE_ITEM_TOKENS):
        group = decodes[a : a + DECODE_ITEM_TOKENS]
        items.append((sum(kv_lens[r] for r, _ in group), [t for _, t in group]))
    items.sort(key=lambda item: -item[0])
    order = [t for _, tokens in items for t in tokens]
    item_ptr = [0]
    for _, tokens in items:
        item_ptr.append(item_ptr[-1] + len(tokens))
    width = max(len(t) for t in tables)
    padded = [t + [t[-1]] * (width - len(t)) for t in tables]

    def i32(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return NativePlan(
        i32(padded),
        i32([len(t) for t in tables]),
        i32(q_seq),
        i32(q_pos),
        i32(order),
        i32(item_ptr),
    )


def attend(
    kernel: ModuleType,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: NativePlan,
    group: int,
    scale: float,
    threads: int = 1,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """q ``[T, Hq, D]`` float32 -> ``[T, Hq, D]`` float32 over the pool layer's pages, on
    ``threads`` threads (one parallel region, whatever torch's own setting); ``softcap`` and
    ``window`` as ``LayerAttention``'s (0: none)."""
    return kernel.exact_attention(
        q.contiguous(), k_pages, v_pages, *plan.tensors(), group, scale, threads, softcap,
        window,
    )


def rope_write_attend(
    kernel: ModuleType,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: NativePlan,
    group: int,
    scale: float,
    threads: int = 1,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """Fused projection rows ``[T, (Hq + 2 Hkv) * D]`` float32 -> ``[T, Hq, D]`` float32: RoPE
    by ``cos``/``sin`` (contiguous float32, ``T * D/2`` values: ``[T, D/2]`` or the model's
    ``[T, 1, D/2]``), the new K/V written at int64 ``slots``, then ``attend``."""
    return kernel.rope_write_attend(
        qkv, cos, sin, slots, k_pages, v_pages, *plan.tensors(), group, scale, threads,
        softcap, window,
    )


class ExactAttentionBackend(AttentionBackend):
    """The batch-invariant attention backend: the kernel, one call per layer. Where the
    kernel cannot be built the engine runs the fast backend, and the dtype probe's check on
    the real forward reports that passes are then not verified invariant."""

    name = "torch"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        kernel: ModuleType,
        threads: int = 1,
        layers: Sequence[LayerAttention] | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device, layers)
        self.kernel = kernel
        self.threads = threads  # every pass's attention runs on this many threads
        self._native: NativePlan | None = None
        self._fb: ForwardBatch | None = None
        self._window_plan: tuple[ForwardBatch, NativePlan] | None = None

    @property
    def kernel_name(self) -> str:
        return "native"

    @property
    def exact(self) -> bool:
        return True

    def supports(self, attention: LayerAttention) -> bool:
        return True  # any scale, soft cap and window

    def plan(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        indptr = fb.kv_indptr.tolist()
        pages = fb.kv_indices.tolist()
        self._fb = fb
        tables = [pages[indptr[b] : indptr[b + 1]] for b in range(fb.batch_size)]
        self._native = plan_native(
            fb.qo_lens, fb.kv_lens, tables, fb.input_ids.device
        )

    def _layer_plan(
        self, layer: int, pool: KVPool, fb: ForwardBatch, plan: NativePlan
    ) -> tuple[torch.Tensor, NativePlan]:
        """The new tokens' slots and the plan for ``layer``: a window layer of a window-aware
        pool reads and writes its window slots."""
        if not pool.is_window(layer):
            return fb.slots, plan
        index = self.window_index(pool, fb)
        made = self._window_plan
        if made is None or made[0] is not fb:
            tables = pool.window_pages_of(plan.tables)
            made = self._window_plan = (fb, replace(plan, tables=tables))
        return index.slots, made[1]

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        fb, plan = self._fb, self._native
        if fb is None or plan is None:
            raise RuntimeError("ExactAttentionBackend.run called before plan")
        slots, plan = self._layer_plan(layer, pool, fb, plan)
        pool.store(layer, slots, k, v)
        hkv, d = self.num_kv_heads, self.head_dim
        g = self.num_heads // hkv
        qn = q.float().view(-1, hkv * g, d)
        spec = self.layer(layer)
        out = attend(
            self.kernel, qn, pool.k_cache[layer], pool.v_cache[layer], plan, g, spec.scale,
            self.threads, spec.softcap, spec.window,
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
        spec = self.layer(layer)
        slots, plan = self._layer_plan(layer, pool, fb, plan)
        out = rope_write_attend(
            self.kernel, qkv, cos, sin, slots, pool.k_cache[layer], pool.v_cache[layer],
            plan, self.num_heads // hkv, spec.scale, self.threads, spec.softcap, spec.window,
        )
        return out.view(-1, self.num_heads * d)
