"""The CPU platform: our own products and attention kernel, thread counts per pass, the memory
and the machine the KV was computed on.

A CPU's BLAS changes its kernels with the row count and the thread split, so the linear layers
run our batch-invariant products (``products``) and exact attention runs our kernel
(``exact_attention``); both are built for this machine and fall back to torch's where they
cannot be. A pass's size sets torch's threads (``threads``); the loop keeps freed memory in the
heap and frees idle OpenMP teams (``malloc_tuning``, ``threads``). The dtype an engine runs in,
and whether its forward is invariant in it, were measured once per machine by the bring-up's
dtype probe.
"""

from __future__ import annotations

import functools

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.cpu import exact_attention
from engine.model.cpu.exact_attention import ExactAttentionBackend
from engine.model.cpu.kernels import kernels_key
from engine.model.cpu.machine import (
    available_memory_bytes,
    bf16_matmul_works,
    cpu_flags,
    machine_key,
    machine_memory_bytes,
)
from engine.model.cpu.malloc_tuning import keep_freed_memory
from engine.model.cpu.products import NativeRowOps, PackedWeight, load_products, tiles_usable
from engine.model.cpu.threads import ThreadPolicy, release_openmp_team
from engine.model.forward_batch import IndexPacker
from engine.model.kv_pool import KVPool
from engine.model.model_config import ModelConfig
from engine.model.platform import (
    EagerPass,
    GraphedPasses,
    KVMemory,
    Packer,
    PlannedForward,
    Platform,
    RowOps,
)

# Default KV budget: 1 GiB (about 23k tokens of SmolLM2-135M in float32), or an eighth of the
# machine's memory when that is smaller.
CPU_KV_BYTES = 1 << 30
# The dtypes our products run (float16 runs torch's, slowly).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class CpuPlatform(Platform):
    """The CPU, running passes on ``threads`` (None: torch's current count, our kernels on one
    thread; an engine's policy comes from ``EngineConfig.threads``)."""

    backends = ("torch",)
    torch_products_invariant = False
    verifies_runner = False

    def __init__(self, device: torch.device, threads: ThreadPolicy | None = None) -> None:
        self.device = device
        self.threads = threads

    def default_backend(self) -> str:
        return "torch"

    def attention_backend(
        self, name: str, config: ModelConfig, exact: bool, threads: int, dtype: torch.dtype
    ) -> AttentionBackend:
        """``torch`` is our exact kernel where asked for and it builds (and the head size fits
        its register tiles), else the fast torch backend."""
        if name not in self.backends:
            raise ValueError(
                f"backend: {name!r} does not run on the CPU platform; available: "
                f"{', '.join(self.backends)}"
            )
        heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        if exact and config.head_dim % exact_attention.HEAD_DIM_MULTIPLE == 0:
            kernel = exact_attention.load_kernel()
            if kernel is not None:
                return ExactAttentionBackend(
                    *heads, self.device, kernel, threads, config.attention_layers
                )
        return TorchAttentionBackend(*heads, self.device, config.attention_layers)

    def packer(self, dtype: torch.dtype) -> Packer | None:
        if dtype not in PACKED_DTYPES:
            return None
        kernel = load_products()
        if kernel is None:
            return None
        tiles = dtype == torch.bfloat16 and tiles_usable(kernel)
        return functools.partial(PackedWeight, kernel, tiles=tiles)

    def row_ops(self) -> RowOps | None:
        kernel = load_products()
        return None if kernel is None else NativeRowOps(kernel)

    @property
    def product_threads(self) -> int:
        return self.threads.max_threads if self.threads is not None else 1

    def pass_threads(self, num_tokens: int) -> None:
        if self.threads is not None:
            self.threads.apply(num_tokens)

    def step_buffers(self) -> IndexPacker | None:
        return None  # the tensors are made where they are used

    def decode_graphs(
        self,
        backend: AttentionBackend,
        pool: KVPool,
        forward: PlannedForward,
        eager: EagerPass | None,
        max_batch: int,
        max_pages_per_entry: int,
        max_rows: int,
    ) -> GraphedPasses:
        raise ValueError(f"cuda_graphs: needs the flashinfer backend, not {backend.name!r}")

    @property
    def captures_graphs(self) -> bool:
        return False

    def on_loop_start(self) -> None:
        # The constructing thread loaded and checked the model: its idle OpenMP team would
        # slow every parallel region of the loop's (``release_openmp_team``).
        release_openmp_team()
        keep_freed_memory()  # a pass's freed buffers serve the next pass without page faults

    def on_loop_idle(self) -> None:
        release_openmp_team()  # idle: another engine's loop may be busy

    def release_cached_memory(self) -> None:
        pass  # freed tensors go back to the heap at once

    def kv_memory(self) -> KVMemory:
        return KVMemory(
            min(CPU_KV_BYTES, machine_memory_bytes() // 8), available_memory_bytes()
        )

    def kv_identity(self, products: str | None) -> str:
        """The machine and the kernels' sources: the kernels that computed the KV."""
        return f"cpu-{machine_key()}-{kernels_key()}-{products or 'torch'}"

    def default_dtype(self) -> torch.dtype | None:
        return None  # the faster of float32 and bfloat16, as measured on this machine

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Refuse bf16 on a CPU whose advertised AMX would crash the process."""
        if dtype != torch.bfloat16 or "amx_tile" not in cpu_flags():
            return
        if not bf16_matmul_works():
            raise ValueError(
                f"dtype: {dtype} matrix products crash on this CPU (AMX advertised but "
                "unusable); use float32, or start Python with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"
            )

    def dtype_warning(self, dtype: torch.dtype) -> str | None:
        """float16 has no fast kernels in torch on a CPU (several times slower than float32)."""
        if dtype != torch.float16:
            return None
        return (
            "dtype: float16 on the CPU runs several times slower than float32 (torch has no "
            "fast CPU kernels for it); use float32, bfloat16, or dtype=None to measure"
        )
