"""On CUDA: FlashInfer's kernels equal their torch reference on the same pool and pass, and
the engine's greedy answers do not depend on the cache. Skipped without CUDA and FlashInfer;
``scripts/gpu_run.sh`` runs them on a lent GPU machine (the model there has random weights
unless ``RADIXKV_GPU_MODEL`` names another: the bundled one cannot travel)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from flashinfer_cases import HKV, HQ, D, build_pass, clone_pool, requests_for

from engine.model.cuda.flashinfer_backend import (
    FlashInferBackend,
    flashinfer_ops,
    reference_ops,
)
from engine.model.forward_batch import ForwardBatch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def on_cuda(fb: ForwardBatch) -> ForwardBatch:
    moved = {
        name: value.to(CUDA) if isinstance(value, torch.Tensor) else value
        for name, value in vars(fb).items()
    }
    return ForwardBatch(**moved)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", ["prefill", "decode", "mixed", "cascade"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_flashinfer_equals_its_reference_on_the_same_pool_and_pass(
    case: str, page_size: int, deterministic: bool
) -> None:
    pytest.importorskip("flashinfer")
    requests = requests_for(case, page_size)
    fb, pool, q, k, v = build_pass(requests, page_size, 0, round_to=torch.bfloat16)
    ref_pool = clone_pool(pool)
    reference = FlashInferBackend(
        HQ, HKV, D, torch.device("cpu"), reference_ops(), torch.float32, min_saved_tokens=1
    )
    reference.plan(fb)
    expected = reference.run(0, q, k, v, ref_pool)

    gpu_pool = clone_pool(pool, CUDA, torch.bfloat16)
    ours = FlashInferBackend(
        HQ, HKV, D, CUDA, flashinfer_ops(), torch.bfloat16,
        deterministic=deterministic, min_saved_tokens=1,
    )
    ours.plan(on_cuda(fb))
    if case == "cascade" and not deterministic:
        assert ours._plan is not None and ours._plan.shared is not None
    bf16 = {"device": CUDA, "dtype": torch.bfloat16}
    out = ours.run(0, q.to(**bf16), k.to(**bf16), v.to(**bf16), gpu_pool)
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)
    # the appended K/V are the reference's, exactly (bf16 values stored as they came)
    assert torch.equal(gpu_pool.k_cache[0].float().cpu(), ref_pool.k_cache[0])
    assert torch.equal(gpu_pool.v_cache[0].float().cpu(), ref_pool.v_cache[0])


@pytest.fixture(scope="module")
def cuda_model() -> Any:
    from engine.model.bringup.load import load_model

    return load_model(os.environ.get("RADIXKV_GPU_MODEL"), "cuda", "bfloat16")


def prompts(vocab: int) -> list[list[int]]:
    """Six prompts: three share a 300-token prefix, two share another, one alone."""
    gen = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    a, b = ids(300), ids(180)
    return [a + ids(20), a + ids(35), a + ids(9), b + ids(40), b + ids(3), ids(77)]


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_greedy_answers_with_the_cache_equal_without_on_cuda(
    cuda_model: Any, cuda_graphs: bool
) -> None:
    """The default engine on CUDA (deterministic plan, verified at start), decode in graphs
    or eager: the cache, the batch and the chunking never change a greedy answer."""
    pytest.importorskip("flashinfer")
    from engine import Engine
    from scheduler import SamplingParams

    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    ps = prompts(cuda_model.config.vocab_size)
    answers = {}
    for name, cache, chunk in (("cache", True, None), ("no cache", False, None),
                               ("chunked", False, 64)):
        extra = {"max_batch_tokens": chunk, "max_running": 8} if chunk else {}
        with Engine(
            model=cuda_model, backend="flashinfer", prefix_cache=cache,
            cuda_graphs=cuda_graphs, num_pages=4096, **extra,
        ) as engine:
            assert engine.batch_invariant and engine.stats().batch_invariant
            engine.generate([ps[0]], params)  # warm the cache with one of the prefixes
            outs = engine.generate(ps, params)
            answers[name] = [o.token_ids for o in outs]
            answers[f"{name}, alone"] = [engine.generate([p], params)[0].token_ids for p in ps]
    first = answers["no cache, alone"]
    assert all(got == first for got in answers.values()), {
        k: sum(a == b for a, b in zip(v, first)) for k, v in answers.items()
    }
