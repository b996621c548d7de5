"""The model families we run, each read from its HF config as its differences from Llama.

A family is a ``model_type`` and a reader that fills ``ModelConfig``'s family fields: Qwen3's
q/k norms, Gemma's sandwich norms, GELU, scaled embeddings, soft caps and sliding windows,
Phi-3's partial rotary and LongRoPE. The decoder (``engine.model.llama``) and the weight
loading read only those fields, never the family's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.model.gguf_metadata import ROPE_DIVISORS_KEY
from engine.model.model_config import GELU_TANH, ModelConfig

ROPE_TYPES = ("default", "llama3", "linear", "longrope", "su")
GLOBAL_LAYER, WINDOW_LAYER = "full_attention", "sliding_attention"


def _llama(hf: Any) -> dict[str, Any]:
    return {"o_bias": bool(getattr(hf, "attention_bias", False))}


def _mistral(hf: Any) -> dict[str, Any]:
    return {**_llama(hf), **_windows(hf, every_layer=True)}


def _qwen2(hf: Any) -> dict[str, Any]:
    return {"attention_bias": True}  # always q/k/v biases, none on o


def _qwen3(hf: Any) -> dict[str, Any]:
    bias = bool(getattr(hf, "attention_bias", False))
    return {"attention_bias": bias, "o_bias": bias, "qk_norm": True, **_windows(hf)}


def _gemma(hf: Any) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new"):  # both GELU's tanh form; erf's is not ours
        raise ValueError(f"hidden_activation: unsupported {act!r} (gelu_pytorch_tanh)")
    bias = bool(getattr(hf, "attention_bias", False))
    return {
        "attention_bias": bias,
        "o_bias": bias,
        "mlp_act": GELU_TANH,
        "sandwich_norm": True,
        "norm_plus_one": True,
        "embed_scale": float(hf.hidden_size) ** 0.5,
        "query_scale": float(hf.query_pre_attn_scalar) ** -0.5,
        "attn_softcap": float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
        "final_softcap": float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        **_windows(hf),
    }


def _gemma3(hf: Any) -> dict[str, Any]:
    out = {**_gemma(hf), "qk_norm": True}
    local = _rope_parameters(hf).get(WINDOW_LAYER)
    if local is not None:
        out["local_rope_theta"] = float(local.get("rope_theta", 10000.0))
    else:
        out["local_rope_theta"] = float(getattr(hf, "rope_local_base_freq", 10000.0))
    return out


def _phi3(hf: Any) -> dict[str, Any]:
    bias = bool(getattr(hf, "attention_bias", False))
    return {"attention_bias": bias, "o_bias": bias, **_windows(hf)}


# model_type -> reader of its family fields
FAMILIES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
}
SUPPORTED_ARCHS = tuple(FAMILIES)
# image-text checkpoints whose language model (``text_config``) is one of the families
MULTIMODAL = ("gemma3",)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def config_from_hf(hf: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    """``ModelConfig`` of an HF ``PretrainedConfig`` (transformers 4.x or 5.x naming);
    ValueError naming the supported families otherwise."""
    arch = getattr(hf, "model_type", None)
    if arch in MULTIMODAL and getattr(hf, "text_config", None) is not None:
        # an image-text checkpoint (Gemma 3 4B and up): its language model, text in, text out
        if not eos_token_ids and getattr(hf, "eos_token_id", None) is not None:
            eos_token_ids = _ids(hf.eos_token_id)
        hf = hf.text_config
        arch = getattr(hf, "model_type", None)
    if arch not in FAMILIES:
        raise ValueError(
            f"model_type: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    num_heads = int(hf.num_attention_heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
    rope = _global_rope(hf)
    fields = FAMILIES[arch](hf)
    max_positions = int(hf.max_position_embeddings)
    scaling, max_positions = _rope_scaling(rope, hf, max_positions)
    rotary = int(head_dim * float(rope.get("partial_rotary_factor", None)
                                  or getattr(hf, "partial_rotary_factor", None) or 1.0))
    if rotary % 2 or rotary > head_dim:
        raise ValueError(f"partial_rotary_factor: {rotary} rotary dims of {head_dim}")
    if not eos_token_ids:
        eos_token_ids = _ids(getattr(hf, "eos_token_id", None))
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        intermediate_size=int(hf.intermediate_size),
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(fields.pop("attention_bias", getattr(hf, "attention_bias", False))),
        eos_token_ids=tuple(int(t) for t in eos_token_ids),
        rotary_dim=0 if rotary == head_dim else rotary,
        **fields,
    )


def _windows(hf: Any, every_layer: bool = False) -> dict[str, Any]:
    """Per-layer sliding windows from ``layer_types`` (transformers 4.5x+ and 5), else every
    layer (Mistral) or Gemma 2's alternation; nothing where every layer is global."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False or not window:
        return {}
    types = getattr(hf, "layer_types", None)
    n = int(hf.num_hidden_layers)
    if types is None and every_layer:
        types = [WINDOW_LAYER] * n
    elif types is None:
        pattern = getattr(hf, "sliding_window_pattern", None) or 2
        types = [GLOBAL_LAYER if (i + 1) % pattern == 0 else WINDOW_LAYER for i in range(n)]
    unknown = set(types) - {GLOBAL_LAYER, WINDOW_LAYER}
    if unknown:
        raise ValueError(f"layer_types: unsupported {sorted(unknown)}")
    windows = tuple(int(window) if t == WINDOW_LAYER else 0 for t in types)
    return {"layer_windows": windows} if any(windows) else {}


def _rope_parameters(hf: Any) -> dict[str, Any]:
    """transformers 5 keeps theta and scaling in ``rope_parameters`` (per layer type where
    they differ); 4.x in ``rope_theta`` and ``rope_scaling``."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    out: dict[str, Any] = dict(getattr(hf, "rope_scaling", None) or {})
    out.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return out


def _global_rope(hf: Any) -> dict[str, Any]:
    params = _rope_parameters(hf)
    if GLOBAL_LAYER in params:
        return dict(params[GLOBAL_LAYER])
    return params


def _rope_scaling(rope: dict[str, Any], hf: Any, max_positions: int) -> tuple[dict | None, int]:
    """Our scaling record and the context we serve. LongRoPE (Phi-3) is served with its short
    factors, as transformers computes every sequence up to ``original_max_position_embeddings``;
    its long factors would re-rotate every cached key once a sequence passes that length, so
    the context stops there."""
    divisors = getattr(hf, ROPE_DIVISORS_KEY, None)
    if divisors:  # a GGUF's rope_freqs tensor (llama.cpp's form of Llama 3's scaling)
        return {"rope_type": "divisors", "divisors": [float(d) for d in divisors]}, max_positions
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} ({', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None, max_positions
    if kind == "llama3":
        return {
            "rope_type": "llama3",
            "factor": float(rope["factor"]),
            "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        }, max_positions
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(rope["factor"])}, max_positions
    original = int(
        rope.get("original_max_position_embeddings")
        or getattr(hf, "original_max_position_embeddings", None)
        or max_positions
    )
    factor = rope.get("factor") or max_positions / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in rope["short_factor"]],
        "attention_factor": float(attention_factor),
    }, min(max_positions, original)
