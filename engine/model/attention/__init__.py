"""Attention backends behind one interface; ``create_backend`` picks one by name."""

from __future__ import annotations

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.model_config import ModelConfig
from engine.model.rows import RowPadding

BACKENDS = ("torch",)


def create_backend(
    name: str, config: ModelConfig, device: torch.device, padding: RowPadding | None = None
) -> AttentionBackend:
    """The backend called ``name`` for a model of ``config`` on ``device``; with ``padding``
    (the measured row padding) the batch-invariant variant, without it the fastest one."""
    if name == "torch" and padding is not None:
        from engine.model.attention.exact_backend import ExactAttentionBackend

        return ExactAttentionBackend(
            config.num_heads, config.num_kv_heads, config.head_dim, device, padding
        )
    if name == "torch":
        from engine.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(config.num_heads, config.num_kv_heads, config.head_dim, device)
    raise ValueError(
        f"backend: unknown attention backend {name!r}; available: {', '.join(BACKENDS)}"
    )


__all__ = ["AttentionBackend", "BACKENDS", "create_backend"]
