"""Attention backends behind one interface; ``create_backend`` picks one by name."""

from __future__ import annotations

import torch

from engine.config import BACKENDS
from engine.model.attention.base import AttentionBackend
from engine.model.model_config import ModelConfig


def create_backend(
    name: str,
    config: ModelConfig,
    device: torch.device,
    exact: bool = False,
    threads: int = 1,
    dtype: torch.dtype = torch.float32,
) -> AttentionBackend:
    """The backend called ``name`` for a model of ``config`` on ``device`` with activations
    and KV in ``dtype``: with ``exact`` the batch-invariant kernel where it builds (the CPU;
    it runs on ``threads`` threads), else the fastest one. ``flashinfer`` is FlashInfer's
    kernels on CUDA and their torch reference elsewhere (for tests: slow)."""
    if name == "flashinfer":
        from engine.model.cuda.cascade_rule import CascadeCosts
        from engine.model.cuda.flashinfer_backend import (
            FlashInferBackend,
            flashinfer_ops,
            reference_ops,
        )

        on_cuda = device.type == "cuda"
        ops = flashinfer_ops() if on_cuda else reference_ops()
        # On the device a cascade must pay for its extra kernels (``cascade_rule``); the
        # CPU reference cascades wherever it saves reads, so its tests exercise the merge.
        return FlashInferBackend(
            config.num_heads, config.num_kv_heads, config.head_dim, device, ops, dtype,
            deterministic=exact, cascade_costs=CascadeCosts() if on_cuda else None,
        )
    if name == "torch" and exact:
        from engine.model.cpu import exact_attention
        from engine.model.cpu.exact_backend import ExactAttentionBackend

        usable = device.type == "cpu" and config.head_dim % exact_attention.HEAD_DIM_MULTIPLE == 0
        kernel = exact_attention.load_kernel() if usable else None
        if kernel is not None:
            return ExactAttentionBackend(
                config.num_heads, config.num_kv_heads, config.head_dim, device, kernel, threads
            )
    if name == "torch":
        from engine.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(config.num_heads, config.num_kv_heads, config.head_dim, device)
    raise ValueError(
        f"backend: unknown attention backend {name!r}; available: {', '.join(BACKENDS)}"
    )


__all__ = ["AttentionBackend", "BACKENDS", "create_backend"]
