"""Every family we run, on a tiny random checkpoint made by transformers' own classes (no
weights can be downloaded here): our logits equal transformers' from the HF directory and from
the GGUF llama.cpp's converter would write, on the platform's packed path and on torch's;
greedy answers equal transformers' for 64 tokens, and do not depend on the batch, the cache or
chunking, also across the sliding window (prompts past it, prefix hits at and past it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_idle_accounting

from engine import Engine, SamplingParams
from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.bringup.load import load_model
from engine.model.bringup.platforms import platform_for
from engine.model.cpu.threads import ThreadPolicy
from engine.model.forward_batch import ForwardBatch
from engine.model.kv_pool import KVPool
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request
from workloads.checkpoints.families import FAMILIES, WINDOW, build, to_gguf

# llama.cpp writes Mistral as a plain Llama (its window is not in the file): HF directory only.
GGUF_FAMILIES = [f for f in FAMILIES if f != "mistral"]
PROMPT_TOKENS = 150  # past every tiny window (16) many times over
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """family -> (its HF directory, transformers' model of it), built once for the module."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, build(family, path))
    return out


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_logits(loaded: Any, backend: Any, ids: list[int]) -> torch.Tensor:
    cfg = loaded.config
    pages = -(-len(ids) // 16)
    pool = KVPool(cfg.num_layers, pages, 16, cfg.num_kv_heads, cfg.head_dim)
    request = Request(0, ids, SamplingParams(max_new_tokens=1))
    batch = Batch([BatchEntry.on_pages(request, ids, 0, list(range(pages)), 16)], 16)
    fb = ForwardBatch.from_batch(batch)
    fb.logits_indices = torch.arange(len(ids))
    with torch.inference_mode():
        return loaded.model(fb, pool, backend)


def _packed(loaded: Any) -> Any:
    """The model on the CPU platform's packed products and exact attention (the engine's)."""
    platform = platform_for(loaded.device, threads=ThreadPolicy(2))
    loaded.model.use_packed_products(platform.packer(torch.float32), platform.row_ops())
    return platform.attention_backend("torch", loaded.config, True, 2, torch.float32)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert float((ours - ref).abs().max()) <= 2e-5 * float(ref.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_on_both_paths(checkpoints: Any, family: str) -> None:
    path, hf = checkpoints[family]
    ids = _ids(PROMPT_TOKENS, 1)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    loaded = load_model(path, "cpu", "float32")
    cfg = loaded.config
    assert cfg.arch == hf.config.model_type
    torch_backend = TorchAttentionBackend(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, loaded.device, cfg.attention_layers
    )
    _assert_close(_prefill_logits(loaded, torch_backend, ids), ref)
    backend = _packed(loaded)
    assert backend.exact and loaded.model.products is not None
    _assert_close(_prefill_logits(loaded, backend, ids), ref)


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_in_llama_cpp_layout_loads_to_the_same_model(checkpoints: Any, family: str) -> None:
    path, hf = checkpoints[family]
    gguf = to_gguf(path, path.parent / f"{family}.gguf")
    loaded = load_model(gguf, "cpu", "float32")
    assert loaded.config.arch == hf.config.model_type
    ids = _ids(PROMPT_TOKENS, 2)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    _assert_close(_prefill_logits(loaded, _packed(loaded), ids), ref)
    assert loaded.tokenizer.chat_template  # the GGUF's template came along


def _hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, do_sample=False, pad_token_id=2, eos_token_id=None,
        )
    return out[0, len(ids):].tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_and_holds_alone_batched_cached_chunked(
    checkpoints: Any, family: str
) -> None:
    path, hf = checkpoints[family]
    loaded = load_model(path, "cpu", "float32")
    shared = _ids(2 * WINDOW + 5, 3)  # a prefix past the window, not on a page boundary
    prompts = [
        shared + _ids(40, 4),
        shared + _ids(7, 5),
        shared[:WINDOW] + _ids(30, 6),  # shares exactly one window's worth
        _ids(90, 7),
    ]
    with Engine(model=loaded, num_pages=128, page_size=8) as eng:
        alone = [eng.generate([p], _greedy(NEW_TOKENS))[0] for p in prompts]
        assert alone[1].cached_tokens > WINDOW and alone[2].cached_tokens >= WINDOW - 8
        assert alone[0].token_ids == _hf_greedy(hf, prompts[0], NEW_TOKENS)
        assert alone[3].token_ids == _hf_greedy(hf, prompts[3], NEW_TOKENS)
        batched = eng.generate(prompts, _greedy(NEW_TOKENS))  # all cached now, in one batch
        assert all(b.cached_tokens > 0 for b in batched[:3])
        assert_idle_accounting(eng)
    with Engine(model=loaded, num_pages=128, page_size=8, prefix_cache=False,
                max_batch_tokens=24, max_running=8) as cold:
        chunked = cold.generate(prompts, _greedy(NEW_TOKENS))
        assert all(c.cached_tokens == 0 for c in chunked)
    for a, b, c in zip(alone, batched, chunked):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == b.logprobs == c.logprobs  # the same bits, not just the argmax


def test_an_image_text_gemma3_checkpoint_runs_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 4B and up are published as image-text checkpoints (``model_type: gemma3``, the
    language model under ``language_model.model.*``): text in, the same logits as
    transformers' image-text model given text alone."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from workloads.checkpoints.families import randomize

    text = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, eos_token_id=1)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(300)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
                            eos_token="t1").save_pretrained(tmp_path)
    loaded = load_model(tmp_path, "cpu", "float32")
    assert loaded.config.arch == "gemma3_text" and loaded.config.layer_windows == (16, 16, 0)
    ids = torch.randint(2, 300, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    _assert_close(_prefill_logits(loaded, _packed(loaded), ids), ref)
