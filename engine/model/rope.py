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


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies of the rotated dims with the config's theta and scaling (llama3,
    linear, LongRoPE's short factors, a GGUF's per-frequency divisors); ``local``: a window layer's (Gemma 3: its own theta,
    no scaling)."""
    dim = config.rotary_dims
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    s = None if local and config.local_rope_theta else config.rope_scaling
    if s is not None and s["rope_type"] == "longrope":
        return 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    if s["rope_type"] == "divisors":
        return inv_freq / torch.tensor(s["divisors"], dtype=torch.float)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Where each dim of a q/k head goes so that partial rotary becomes the half-split layout
    every kernel turns: the rotated pairs (i, i + R/2) land on (i, i + D/2) for i < R/2, the
    unturned dims on the other pairs, whose angle is 0. Dot products of q and k are unchanged
    (both are permuted alike); only the order of their terms moves."""
    r, d = rotary_dim // 2, head_dim
    rest = (d - rotary_dim) // 2
    first = list(range(r)) + list(range(rotary_dim, rotary_dim + rest))
    second = list(range(r, rotary_dim)) + list(range(rotary_dim + rest, d))
    return torch.tensor(first + second)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the model's context, looked up once per pass.
    With partial rotary the tables cover half the head: the turned pairs' angles, then angle
    0 (cos 1, sin 0) for the pairs ``rotary_permutation`` parks the unturned dims on."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config, local)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        s = None if local and config.local_rope_theta else config.rope_scaling
        gain = s.get("attention_factor", 1.0) if s is not None else 1.0
        cos, sin = freqs.cos(), freqs.sin()
        if gain != 1.0:
            cos, sin = cos * gain, sin * gain
        pad = (config.head_dim - config.rotary_dims) // 2
        if pad:
            cos = torch.cat([cos, torch.ones(len(pos), pad)], dim=1)
            sin = torch.cat([sin, torch.zeros(len(pos), pad)], dim=1)
        # Half-split layout: both halves of a head use the same angles, so one half is stored.
        self.register_buffer("cos", cos.contiguous(), persistent=False)
        self.register_buffer("sin", sin.contiguous(), persistent=False)

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
