"""Rotary position embedding: the cos/sin tables of a model, and the rotation itself.

Half-split layout (transformers' ``rotate_half``): a head's pairs are (i, i + D/2). The
native attention kernel applies the same rotation itself, fused with the K/V write
(``engine.model.cpu.exact_attention``); this module's ``apply_rope_`` serves the other backends.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.model_config import ModelConfig

# cos and sin ``[T, 1, head_dim / 2]`` of each token's position in a pass.
Rope = tuple[torch.Tensor, torch.Tensor]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the config's theta, and llama3 frequency scaling if set."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the model's context, looked up once per pass."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        # Half-split layout: both halves of a head use the same angles, so one half is stored.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin ``[T, 1, head_dim / 2]`` of each token's position."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` ``[T, H, D]`` in place (half-split layout: pairs are (i, i + D/2)).

    Equals transformers' ``x * cos + rotate_half(x) * sin`` without building ``rotate_half``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    first = x1 * cos - x2 * sin
    x2.mul_(cos).addcmul_(x1, sin)
    x1.copy_(first)
