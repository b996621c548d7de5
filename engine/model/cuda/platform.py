"""The CUDA platform: FlashInfer's attention, cuBLAS's products, one packed copy per pass and
decode graphs, the runner checked at start.

The same platform runs FlashInfer's torch reference on a CPU device (the bring-up pairs it with
the CPU platform there: how CI tests this path), so what only a GPU can do (FlashInfer's
kernels, capturing graphs, the cascade's cost rule, the device's memory) is decided here by the
device it was given.
"""

from __future__ import annotations

import importlib.util

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.cuda.cascade_rule import CascadeCosts
from engine.model.cuda.flashinfer_backend import FlashInferBackend, flashinfer_ops, reference_ops
from engine.model.cuda.graphs import MAX_VERIFY_ROWS, DecodeGraphs
from engine.model.cuda.step_buffers import StepBuffers
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
)

# Default KV budget: a share of the memory free after the weights are loaded.
CUDA_KV_FRACTION = 0.7


class CudaPlatform(Platform):
    """A CUDA device (or, for FlashInfer's reference, the CPU device it runs on)."""

    backends = ("torch", "flashinfer")
    torch_products_invariant = True
    verifies_runner = True

    def __init__(self, device: torch.device) -> None:
        if self._on_gpu(device) and not torch.cuda.is_available():
            raise ValueError(f"device: {str(device)!r} requested but CUDA is not available")
        self.device = device

    @staticmethod
    def _on_gpu(device: torch.device) -> bool:
        return device.type == "cuda"

    def default_backend(self) -> str:
        """FlashInfer where it is installed (the ``gpu`` extra), else torch's."""
        return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "torch"

    def attention_backend(
        self, name: str, config: ModelConfig, exact: bool, threads: int, dtype: torch.dtype
    ) -> AttentionBackend:
        """``flashinfer``: FlashInfer's kernels on the GPU, their torch reference elsewhere (for
        tests: slow), deterministic where ``exact``; ``torch``: SDPA and the torch decode."""
        heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        if name == "flashinfer":
            if not config.plain_attention:
                raise ValueError(
                    f"model: {config.arch}'s attention (a score scale, soft cap or sliding "
                    "window) is not wired to FlashInfer yet; use backend='torch' on CUDA"
                )
            on_gpu = self._on_gpu(self.device)
            ops = flashinfer_ops() if on_gpu else reference_ops()
            # On the device a cascade must pay for its extra kernels (``cascade_rule``); the
            # CPU reference cascades wherever it saves reads, so its tests exercise the merge.
            return FlashInferBackend(
                *heads, self.device, ops, dtype, deterministic=exact,
                cascade_costs=CascadeCosts() if on_gpu else None,
            )
        if name == "torch":
            return TorchAttentionBackend(*heads, self.device, config.attention_layers)
        raise ValueError(
            f"backend: unknown attention backend {name!r}; available: {', '.join(self.backends)}"
        )

    def packer(self, dtype: torch.dtype) -> Packer | None:
        return None  # cuBLAS's products, whose rows do not depend on the row count

    @property
    def product_threads(self) -> int:
        return 1

    def pass_threads(self, num_tokens: int) -> None:
        pass  # the device runs the pass

    def step_buffers(self) -> IndexPacker | None:
        return StepBuffers(self.device)

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
        """Over FlashInfer wrappers in graph mode made from ``backend`` (on the CPU: the same
        buffers and plans, uncaptured); verify graphs only where the plan is deterministic
        (speculation runs only there; the default plan's graph wrappers are FlashInfer's
        decode wrapper, one row per entry)."""
        if not isinstance(backend, FlashInferBackend):
            raise ValueError(f"cuda_graphs: needs the flashinfer backend, not {backend.name!r}")
        return DecodeGraphs(
            pool, backend.for_graph, forward, max_batch, max_pages_per_entry,
            capture=self.captures_graphs, eager=eager,
            max_rows=min(max_rows, MAX_VERIFY_ROWS) if backend.deterministic else 0,
        )

    @property
    def captures_graphs(self) -> bool:
        return self._on_gpu(self.device)

    def on_loop_start(self) -> None:
        pass

    def on_loop_idle(self) -> None:
        pass

    def release_cached_memory(self) -> None:
        if self._on_gpu(self.device):
            torch.cuda.empty_cache()

    def kv_memory(self) -> KVMemory:
        free, _total = torch.cuda.mem_get_info(self.device)
        return KVMemory(int(free * CUDA_KV_FRACTION), free)

    def kv_identity(self, products: str | None) -> str:
        """The device's name and torch's version (its kernels and cuBLAS's)."""
        return f"cuda-{torch.cuda.get_device_name(self.device)}-{torch.__version__}"

    def default_dtype(self) -> torch.dtype | None:
        return torch.bfloat16

    def check_dtype(self, dtype: torch.dtype) -> None:
        pass

    def dtype_warning(self, dtype: torch.dtype) -> str | None:
        return None
