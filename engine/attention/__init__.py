"""Attention backends behind one interface; ``create_backend`` picks one by name."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.model_config import ModelConfig

BACKENDS = ("torch",)


def create_backend(name: str, config: ModelConfig, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` for a model of ``config`` on ``device``."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(config.num_heads, config.num_kv_heads, config.head_dim, device)
    raise ValueError(
        f"backend: unknown attention backend {name!r}; available: {', '.join(BACKENDS)}"
    )


__all__ = ["AttentionBackend", "BACKENDS", "create_backend"]
