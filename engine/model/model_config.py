"""The model's shape and hyper-parameters, independent of transformers' config classes."""

from __future__ import annotations

from typing import Any

import msgspec

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


class ModelConfig(msgspec.Struct, frozen=True):
    """What our Llama-family forward needs to know; built from an HF config by ``from_hf``."""

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

    @classmethod
    def from_hf(cls, hf_config: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Read an HF ``PretrainedConfig`` (transformers 4.x or 5.x naming)."""
        arch = getattr(hf_config, "model_type", None)
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"model_type: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        num_heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope = _rope_parameters(hf_config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r} (default, llama3)")
        scaling = None
        if rope_type == "llama3":
            scaling = {
                "rope_type": "llama3",
                "factor": float(rope["factor"]),
                "low_freq_factor": float(rope["low_freq_factor"]),
                "high_freq_factor": float(rope["high_freq_factor"]),
                "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            }
        # Qwen2 always carries q/k/v bias; Llama/Mistral say so in attention_bias.
        attention_bias = arch == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
        if not eos_token_ids:
            eos = getattr(hf_config, "eos_token_id", None)
            eos_token_ids = (
                tuple(eos)
                if isinstance(eos, (list, tuple))
                else ((int(eos),) if eos is not None else ())
            )
        return cls(
            arch=arch,
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(hf_config.intermediate_size),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(hf_config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            eos_token_ids=tuple(int(t) for t in eos_token_ids),
        )


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers 5 keeps theta and scaling in ``rope_parameters``; 4.x in two attributes."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    out: dict[str, Any] = dict(getattr(hf_config, "rope_scaling", None) or {})
    out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return out
