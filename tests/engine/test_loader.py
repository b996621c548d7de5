"""Loading: bundled GGUF via the safetensors cache, HF directories, dtype/device choice, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.bringup.load import load_model, resolve_dtype
from engine.model.bringup.platforms import resolve_device
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from engine.model.loader import checkpoint_dir, resolve_source
from scheduler import SamplingParams
from scheduler.batch import Batch
from scheduler.request import Request


def test_bundled_model_config_is_smollm2_135m(loaded_fp32: Any) -> None:
    cfg = loaded_fp32.config
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert loaded_fp32.tokenizer.convert_ids_to_tokens(list(cfg.eos_token_ids)) == ["<|im_end|>"]
    assert loaded_fp32.dtype == torch.float32
    assert loaded_fp32.source.name.endswith(".gguf")
    model = loaded_fp32.model
    assert torch.equal(model.lm_head.weight_t.t(), model.embed_tokens.weight)  # tied, transposed


def test_tokenizer_has_a_chat_template(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "Hi" in text and "<|im_start|>" in text


def test_gguf_is_cached_as_an_hf_checkpoint_without_the_tied_head(loaded_fp32: Any) -> None:
    from safetensors import safe_open

    ckpt = checkpoint_dir(loaded_fp32.source)
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert not list(ckpt.parent.glob(".tmp-*"))  # no half-written cache left behind


def test_dtype_resolution() -> None:
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype(None, "cpu") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(torch.int32, "cpu")


def test_device_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            resolve_device("cuda")


def test_missing_path_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_source(tmp_path / "nope")


def test_file_that_is_not_gguf_raises_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        load_model(bad)


def test_directory_without_config_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


def test_unknown_architecture_raises_value_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path)


def _tiny_checkpoint(path: Path, kind: str) -> Any:
    """A random tiny HF model of ``kind`` saved to ``path``; returns the transformers model."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=5000.0)
    else:
        config = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if kind == "qwen2":  # random biases, so a dropped bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "llama3-rope"])
def test_hf_directory_checkpoints_match_transformers(
    tmp_path: Path, make_entry: Any, kind: str
) -> None:
    hf = _tiny_checkpoint(tmp_path, kind)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, "a"))
    ).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, "cpu", "float32")
    cfg = loaded.config
    assert cfg.attention_bias == (kind == "qwen2")
    assert (cfg.rope_scaling is not None) == (kind == "llama3-rope")
    ids = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    pool = KVPool(cfg.num_layers, 10, 16, cfg.num_kv_heads, cfg.head_dim)
    batch = Batch([make_entry(Request(0, ids, SamplingParams(max_new_tokens=4)), ids, 0, list(range(10)), 16)], 16)
    fb = ForwardBatch.from_batch(batch)
    fb.logits_indices = torch.arange(len(ids))
    backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, loaded.device)
    with torch.inference_mode():
        ours = loaded.model(fb, pool, backend)
        ref = hf(torch.tensor([ids])).logits[0]
    assert float((ours - ref).abs().max()) < 1e-4
