"""What transformers' GGUF reader leaves out of a family's config, read from llama.cpp's keys.

transformers converts a GGUF's weights and tokenizer and maps a few hyper-parameters; the
rest of its config keeps the class defaults. Those defaults are right for some checkpoints
and wrong for others (Gemma 2's soft caps, Gemma 3's window pattern and RoPE bases, Phi-3's
partial rotary and LongRoPE factors, Qwen3's head size, Llama 3's frequency scaling, which
llama.cpp keeps as a ``rope_freqs`` tensor). ``complete_config`` sets them from the file, as
llama.cpp itself reads them, before the converted checkpoint is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The GGUF's tensor of per-frequency divisors (Llama 3's scaling, llama.cpp's way): kept in
# the converted config under this key, read by ``engine.model.families``.
ROPE_DIVISORS_KEY = "radixkv_rope_divisors"


def complete_config(gguf_path: Path, hf_config: Any) -> None:
    """Set on ``hf_config`` (transformers' config of the converted model) what the GGUF at
    ``gguf_path`` says and transformers did not read."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    fields = {name: field.contents() for name, field in reader.fields.items()
              if not name.startswith("tokenizer.")}
    arch = fields.get("general.architecture", "")

    def key(name: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{name}", default)

    tensors = {t.name: t for t in reader.tensors}
    heads = int(key("attention.head_count", hf_config.num_attention_heads))
    head_dim = key("attention.key_length")
    if head_dim is not None:
        hf_config.head_dim = int(head_dim)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    rope = _rope_of(hf_config)
    if "rope_freqs.weight" in tensors:
        divisors = [float(x) for x in tensors["rope_freqs.weight"].data]
        setattr(hf_config, ROPE_DIVISORS_KEY, divisors)
    if arch in ("gemma2", "gemma3"):
        hf_config.query_pre_attn_scalar = _gemma_query_scalar(arch, hf_config, head_dim)
        window = key("attention.sliding_window")
        if window:
            hf_config.sliding_window = int(window)
    if arch == "gemma2":
        hf_config.attn_logit_softcapping = key("attn_logit_softcapping")
        hf_config.final_logit_softcapping = key("final_logit_softcapping")
    if arch == "gemma3":
        pattern = key("attention.sliding_window_pattern")
        layers = int(hf_config.num_hidden_layers)
        if isinstance(pattern, list):
            windowed = [bool(p) for p in pattern]
        else:  # llama.cpp's Gemma 3 default: every sixth layer global
            every = int(pattern or 6)
            windowed = [(i + 1) % every != 0 for i in range(layers)]
        hf_config.layer_types = [
            "sliding_attention" if w else "full_attention" for w in windowed
        ]
        full = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1e6))}
        if key("rope.scaling.type") == "linear":
            full = {**full, "rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 1e4))}
        hf_config.rope_parameters = {"full_attention": full, "sliding_attention": local}
    if arch == "phi3":
        rotary = key("rope.dimension_count")
        if rotary is not None:
            rope["partial_rotary_factor"] = int(rotary) / head_dim
        if "rope_factors_short.weight" in tensors:
            original = int(key("rope.scaling.original_context_length"))
            rope.update(
                rope_type="longrope",
                short_factor=[float(x) for x in tensors["rope_factors_short.weight"].data],
                long_factor=[float(x) for x in tensors["rope_factors_long.weight"].data],
                original_max_position_embeddings=original,
            )
            hf_config.original_max_position_embeddings = original
            factor = key("rope.scaling.attn_factor")
            if factor is not None:
                rope["attention_factor"] = float(factor)
        hf_config.rope_parameters = rope


def _rope_of(hf_config: Any) -> dict[str, Any]:
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    out = dict(getattr(hf_config, "rope_scaling", None) or {})
    out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    out.setdefault("rope_type", "default")
    return out


def _gemma_query_scalar(arch: str, hf_config: Any, head_dim: int) -> int:
    """llama.cpp scales Gemma's scores by 1 / sqrt(head_dim), except the 27B models (46
    layers of Gemma 2, 62 of Gemma 3), whose ``query_pre_attn_scalar`` is hidden / heads."""
    layers = int(hf_config.num_hidden_layers)
    if (arch, layers) in (("gemma2", 46), ("gemma3", 62)):
        return int(hf_config.hidden_size) // int(hf_config.num_attention_heads)
    return head_dim


def chat_template(gguf_path: Path) -> str | None:
    """The GGUF's chat template (``tokenizer.chat_template``), which transformers' tokenizer
    conversion does not always carry over; None where the file has none."""
    import gguf

    field = gguf.GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())
