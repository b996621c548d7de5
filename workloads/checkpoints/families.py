"""Random-weight checkpoints of every family we run, as HF directories and as GGUF files.

No weights can be downloaded here, so each family is checked on a checkpoint made by
transformers' own config and model classes with random weights: tiny ones for the tests
(seconds), and a ~0.5B shape for ``workloads.model_bench --model``. Each gets the bundled
model's tokenizer (a real BPE of 49,152 tokens), so the GGUF has a tokenizer llama.cpp's
way too. The GGUF is written as llama.cpp's converter writes that architecture: its tensor
names (``gguf.TensorNameMap``), Gemma's norms stored as w + 1, Llama's q/k rows in
llama.cpp's rotary order, Phi-3's LongRoPE factors as tensors, its hyper-parameters under
llama.cpp's keys.

    python -m workloads.checkpoints.families build gemma3 /tmp/gemma3-0.5b --shape 0.5b --gguf
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
WINDOW = 16  # the tiny shapes' sliding window: a test's prompts cross it

# hidden, intermediate, layers, heads, kv heads (head_dim = hidden / heads)
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 192, 3, 4, 2),
    "0.5b": (1024, 4096, 24, 16, 4),
}


def hf_config(family: str, shape: str, vocab: int, eos: int, bos: int) -> Any:
    """transformers' config of ``family`` at ``shape``, with the variants that family has
    switched on where a test can see them (small windows, soft caps, partial rotary)."""
    import transformers as tf

    hidden, inter, layers, heads, kv = SHAPES[shape]
    tiny = shape == "tiny"
    window = WINDOW if tiny else 1024
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=eos,
        bos_token_id=bos, pad_token_id=eos,
    )
    alternate = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    five_to_one = [
        "full_attention" if (i + 1) % (3 if tiny else 6) == 0 else "sliding_attention"
        for i in range(layers)
    ]
    if family == "llama":
        return tf.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64 if tiny else 1024})
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=window)
    if family == "qwen2":
        return tf.Qwen2Config(**common, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1000000.0})
    if family == "qwen3":
        return tf.Qwen3Config(**common)
    if family.startswith("gemma"):
        common["tie_word_embeddings"] = True  # as every Gemma (llama.cpp has no output tensor)
    if family == "gemma2":
        return tf.Gemma2Config(
            **common, query_pre_attn_scalar=hidden // heads, attn_logit_softcapping=50.0 if not tiny
            else 2.0, final_logit_softcapping=30.0 if not tiny else 3.0, sliding_window=window,
            layer_types=alternate)
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **common, query_pre_attn_scalar=hidden // heads, sliding_window=window,
            layer_types=five_to_one, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0,
                                   "rope_theta": 1000000.0}})
    if family == "phi3":
        rotary = (hidden // heads) // 2  # partial rotary: half of each head turns
        return tf.Phi3Config(**common, original_max_position_embeddings=1024, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.05 * i for i in range(rotary // 2)],
            "long_factor": [2.0 + 0.1 * i for i in range(rotary // 2)]})
    raise ValueError(f"family: unknown {family!r}; known: {', '.join(FAMILIES)}")


def build(family: str, target: Path, shape: str = "tiny", seed: int = 0,
          dtype: torch.dtype = torch.float32) -> Any:
    """A checkpoint directory at ``target``: the bundled tokenizer and chat template, and a
    random ``family`` model of ``shape`` (seeded). Returns the transformers model (float32)."""
    from transformers import AutoModelForCausalLM

    from workloads.checkpoints.random_model import FRONT_FILES, pack_front

    if shape not in SHAPES:
        raise ValueError(f"shape: unknown {shape!r}; known: {', '.join(SHAPES)}")
    front = pack_front(target / ".front")
    bundled = json.loads((front / "config.json").read_text())
    config = hf_config(family, shape, bundled["vocab_size"], 2, 1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model)
    model.to(dtype).save_pretrained(target)
    for name in FRONT_FILES[2:]:  # the tokenizer and its chat template
        if (front / name).is_file():
            shutil.copy2(front / name, target / name)
    shutil.rmtree(front)
    return model.float()


@torch.no_grad()
def randomize(model: Any) -> None:
    """Weights that make every piece matter: products at unit gain (activations stay O(1) at
    any width), the LM head wider so top-2 margins are not ties, norm weights around 1 (Gemma
    stores w - 1: around 0), biases small but non-zero."""
    gemma = model.config.model_type.startswith("gemma")
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(torch.randn_like(p) * 0.3 + (0.0 if gemma else 1.0))
        elif p.dim() == 1:
            p.normal_(0, 0.1)
        elif "embed_tokens" in name:
            p.normal_(0, 1.0 / (p.shape[1] ** 0.5 if gemma else 1.0))
        else:
            p.normal_(0, (4.0 if "lm_head" in name else 1.0) / p.shape[1] ** 0.5)


# ---------------------------------------------------------------------------------- GGUF


def to_gguf(checkpoint: Path, path: Path) -> Path:
    """``checkpoint`` (a directory ``build`` wrote) as a float32 GGUF file at ``path``, the
    way llama.cpp's converter writes its architecture, with the bundled GGUF's tokenizer."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from engine import bundled_gguf_path

    cfg = json.loads((checkpoint / "config.json").read_text())
    kind = cfg["model_type"]
    arch_name = {"mistral": "llama", "gemma3_text": "gemma3"}.get(kind, kind)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    layers, heads, kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    state = {k: v.float() for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    rotary = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_dimension_count(rotary)
    # llama.cpp writes Mistral as a plain Llama, without its window
    if cfg.get("sliding_window") and kind not in ("qwen2", "mistral"):
        writer.add_sliding_window(cfg["sliding_window"])
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if kind == "gemma3_text":
        types = cfg["layer_types"]
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        local = cfg["rope_parameters"]["sliding_attention"]
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
    if kind == "llama" and rope.get("rope_type") == "llama3":
        _llama3_factors(writer, rope, head_dim)
    if kind == "phi3":
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(_longrope_attention_factor(cfg, rope))
        for which in ("short", "long"):
            tensor = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[f"ROPE_FACTORS_{which.upper()}"]]
            writer.add_tensor(tensor + ".weight",
                              np.asarray(rope[f"{which}_factor"], dtype=np.float32))
    _copy_tokenizer(writer, gguf.GGUFReader(str(bundled_gguf_path())))
    for name, tensor in state.items():
        data = tensor
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp stores Gemma's RMSNorm weight as 1 + w
        if arch_name == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if name.endswith("q_proj.weight") else kv
            data = _to_interleaved_rotary(data, n)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"gguf: no llama.cpp name for {name!r} in {arch_name}")
        writer.add_tensor(gguf_name, data.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _to_interleaved_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp turns a Llama head's pairs (2i, 2i + 1); transformers (i, i + D/2): its
    converter reorders each head's q/k rows, and transformers' reader undoes it."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_factors(writer: Any, rope: dict[str, Any], head_dim: int) -> None:
    """llama.cpp keeps Llama 3's frequency scaling as a ``rope_freqs`` tensor of divisors."""
    import math

    import gguf
    import numpy as np

    base = float(rope["rope_theta"])
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    writer.add_tensor(name, np.asarray(divisors, dtype=np.float32))


def _longrope_attention_factor(cfg: dict[str, Any], rope: dict[str, Any]) -> float:
    import math

    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(cfg["original_max_position_embeddings"]))


def _copy_tokenizer(writer: Any, reader: Any) -> None:
    """Every ``tokenizer.*`` key of ``reader`` into ``writer``, with its type."""
    import gguf

    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help="a random-weight checkpoint of a family")
    make.add_argument("family", choices=FAMILIES)
    make.add_argument("target", type=Path)
    make.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--gguf", action="store_true", help="also write target/model.gguf")
    args = ap.parse_args(argv)
    build(args.family, args.target, args.shape, args.seed)
    print(args.target)
    if args.gguf:
        print(to_gguf(args.target, args.target / "model.gguf"))


if __name__ == "__main__":
    main()
