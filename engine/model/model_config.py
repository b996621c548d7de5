"""The model's shape and hyper-parameters, independent of transformers' config classes.

One decoder serves every family; a family is the set of fields below where it differs from
Llama's defaults. ``engine.model.families`` reads each family's HF config into them.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Activations of the MLP's gate: SiLU (Llama, Qwen, Phi) or tanh-approximated GELU (Gemma).
SILU, GELU_TANH = "silu", "gelu_tanh"


class LayerAttention(msgspec.Struct, frozen=True):
    """How one layer's attention differs from plain causal softmax(q.k / sqrt(d)) v: its
    score scale, a soft cap on the scores (``cap * tanh(s / cap)``; 0: none) and a sliding
    window (a query at position p sees keys p - window + 1 .. p; 0: every earlier key)."""

    scale: float
    softcap: float = 0.0
    window: int = 0


class ModelConfig(msgspec.Struct, frozen=True):
    """What our decoder needs to know; read from an HF config by
    ``engine.model.families.config_from_hf``."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    # --- where families differ from Llama (defaults: Llama's) ---
    o_bias: bool = False  # a bias on the attention output (Llama's attention_bias has one)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    mlp_act: str = SILU
    sandwich_norm: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    norm_plus_one: bool = False  # checkpoints store RMSNorm weights as w - 1 (Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    query_scale: float = 0.0  # attention's score scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap) (Gemma 2)
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window, 0 = global; (): all global
    local_rope_theta: float = 0.0  # RoPE base of the window layers (Gemma 3); 0: rope_theta
    rotary_dim: int = 0  # dims of a head RoPE turns (Phi's partial rotary); 0: head_dim

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s attention variant."""
        window = self.layer_windows[layer] if self.layer_windows else 0
        scale = self.query_scale or self.head_dim**-0.5
        return LayerAttention(scale, self.attn_softcap, window)

    @property
    def attention_layers(self) -> tuple[LayerAttention, ...]:
        return tuple(self.layer_attention(i) for i in range(self.num_layers))

    @property
    def plain_attention(self) -> bool:
        """Every layer is plain causal attention at head_dim ** -0.5 (what every backend runs)."""
        return all(a == LayerAttention(self.head_dim**-0.5) for a in self.attention_layers)

    @property
    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def is_window_layer(self, layer: int) -> bool:
        return bool(self.layer_windows) and self.layer_windows[layer] > 0
