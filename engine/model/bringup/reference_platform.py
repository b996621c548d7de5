"""FlashInfer's torch reference on a CPU device: how CI runs the CUDA path without a GPU.

The CUDA platform gives the attention (FlashInfer's calls, in torch), the decode graphs
(uncaptured) and the start-up check (the runner checked itself); the CPU platform gives
everything else (our products, the threads, the memory, the machine the KV was computed on,
the dtype), as an engine on that CPU would have them.
"""

from __future__ import annotations

import torch

from engine.model.attention.base import AttentionBackend
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


class ReferencePlatform(Platform):
    """``attention``'s backends, graphs and start-up check over ``host``'s device and
    everything else of it."""

    def __init__(self, host: Platform, attention: Platform) -> None:
        self.host = host
        self.attention = attention
        self.device = host.device
        self.backends = attention.backends
        self.torch_products_invariant = host.torch_products_invariant
        self.verifies_runner = attention.verifies_runner

    def default_backend(self) -> str:
        return self.host.default_backend()

    def attention_backend(
        self, name: str, config: ModelConfig, exact: bool, threads: int, dtype: torch.dtype
    ) -> AttentionBackend:
        owner = self.attention if name in self.attention.backends else self.host
        return owner.attention_backend(name, config, exact, threads, dtype)

    def packer(self, dtype: torch.dtype) -> Packer | None:
        return self.host.packer(dtype)

    def row_ops(self) -> RowOps | None:
        return self.host.row_ops()

    @property
    def product_threads(self) -> int:
        return self.host.product_threads

    def pass_threads(self, num_tokens: int) -> None:
        self.host.pass_threads(num_tokens)

    def step_buffers(self) -> IndexPacker | None:
        return self.host.step_buffers()

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
        return self.attention.decode_graphs(
            backend, pool, forward, eager, max_batch, max_pages_per_entry, max_rows
        )

    @property
    def captures_graphs(self) -> bool:
        return self.host.captures_graphs

    def on_loop_start(self) -> None:
        self.host.on_loop_start()

    def on_loop_idle(self) -> None:
        self.host.on_loop_idle()

    def release_cached_memory(self) -> None:
        self.host.release_cached_memory()

    def kv_memory(self) -> KVMemory:
        return self.host.kv_memory()

    def kv_identity(self, products: str | None) -> str:
        return self.host.kv_identity(products)

    def default_dtype(self) -> torch.dtype | None:
        return self.host.default_dtype()

    def check_dtype(self, dtype: torch.dtype) -> None:
        self.host.check_dtype(dtype)

    def dtype_warning(self, dtype: torch.dtype) -> str | None:
        return self.host.dtype_warning(dtype)
