"""On CUDA: decode graphs give the eager pass's logits bit for bit, a step makes one packed
copy to the device, and the default engine replays graphs. Skipped without CUDA and
FlashInfer (``scripts/gpu_run.sh`` runs them on a lent GPU, random weights unless
``RADIXKV_GPU_MODEL`` names a checkpoint)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from flashinfer_cases import flashinfer_runner

from engine.model.kv_pool import KVPool
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch, BatchEntry
from scheduler.request import Request

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PS = 16


@pytest.fixture(scope="module")
def cuda_model() -> Any:
    pytest.importorskip("flashinfer")
    from engine.model.bringup.load import load_model

    return load_model(os.environ.get("RADIXKV_GPU_MODEL"), "cuda", "bfloat16")


def _runner(model: Any, graphs: bool) -> ModelRunner:
    cfg = model.config
    pool = KVPool(cfg.num_layers, 512, PS, cfg.num_kv_heads, cfg.head_dim, model.dtype, "cuda",
                  scratch_pages=1)
    return flashinfer_runner(model, pool, batch_invariant=True, cuda_graphs=graphs, max_batch=16)


def _passes(lengths: list[int]) -> tuple[Batch, Batch]:
    """A prefill of each request's first ``n - 1`` tokens, then one decode each."""
    prefill, decode, page = [], [], 0
    for i, n in enumerate(lengths):
        need = -(-n // PS)
        table = list(range(page, page + need))
        ids = [(31 * i + 7 * j) % 5000 + 10 for j in range(n - 1)]
        req = Request(i, ids, SamplingParams(max_new_tokens=2), output=[11])
        prefill.append(BatchEntry.on_pages(req, ids, 0, table, PS))
        decode.append(BatchEntry.on_pages(req, [11], n - 1, table, PS))
        page += need
    return Batch(prefill, PS), Batch(decode, PS)


@pytest.mark.parametrize("lengths", [[40], [17, 300, 64], [5, 9, 70, 2, 16, 31, 200, 33, 90]])
def test_a_graph_decode_gives_the_eager_logits_bit_for_bit(
    cuda_model: Any, lengths: list[int]
) -> None:
    """Deterministic plan: a row padded into a bucket's graph is the eager row."""
    eager, graphs = _runner(cuda_model, False), _runner(cuda_model, True)
    prefill, decode = _passes(lengths)
    eager.forward(prefill)
    graphs.forward(prefill)
    assert graphs.graphs is not None and graphs.graphs.replays == 0
    want = eager.forward(decode).clone()
    graphs.graphs.eager = None  # compare here, not in the graphs' own first-replay check
    got = graphs.forward(decode).clone()
    assert graphs.graphs.replays == 1
    assert torch.equal(got, want)


def test_an_eager_pass_copies_its_integers_to_the_device_once(cuda_model: Any) -> None:
    runner = _runner(cuda_model, False)
    assert runner.buffers is not None
    prefill, decode = _passes([30, 50, 7])
    before = runner.buffers.copies
    runner.forward(prefill)
    runner.forward(decode)
    assert runner.buffers.copies == before + 2


def test_the_default_cuda_engine_decodes_in_graphs_and_is_verified_invariant(
    cuda_model: Any,
) -> None:
    from engine import Engine

    with Engine(model=cuda_model, num_pages=2048) as engine:
        assert engine.batch_invariant and engine.stats().batch_invariant
        graphs = engine._loop._runner.graphs  # the engine's own runner
        assert graphs is not None
        before = graphs.replays
        engine.generate([[100 + i for i in range(40)]] * 3,
                        SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        assert graphs.replays > before
        assert not graphs.retired  # every bucket used equalled its eager pass


def _verify(lengths: list[int], drafts: list[int]) -> tuple[Batch, Batch]:
    """A prefill of each request's first ``n - 1`` tokens, then a verify pass: its last token
    and a draft of ``k`` tokens, every row sampled."""
    prefill, verify, page = [], [], 0
    for i, (n, k) in enumerate(zip(lengths, drafts)):
        table = list(range(page, page + -(-(n + k) // PS)))
        ids = [(31 * i + 7 * j) % 5000 + 10 for j in range(n - 1)]
        draft = [(13 * i + j) % 5000 + 10 for j in range(k)]
        req = Request(i, ids, SamplingParams(max_new_tokens=k + 2), output=[11])
        prefill.append(BatchEntry.on_pages(req, ids, 0, table, PS))
        entry = BatchEntry.on_pages(req, [11] + draft, n - 1, table, PS)
        entry.draft = draft
        verify.append(entry)
        page += len(table)
    return Batch(prefill, PS), Batch(verify, PS)


@pytest.mark.parametrize("lengths, drafts", [([40], [3]), ([17, 300, 64], [0, 8, 2]),
                                             ([5, 9, 70, 2, 16, 31, 200], [8, 1, 0, 4, 2, 7, 3])])
def test_a_verify_pass_in_a_graph_gives_the_eager_logits_bit_for_bit(
    cuda_model: Any, lengths: list[int], drafts: list[int]
) -> None:
    """Speculation's verify rows padded into a graph of B entries and T rows (FlashInfer plans
    its tiles from T in graph mode, from the pass's own rows eagerly) are the eager rows."""
    cfg = cuda_model.config

    def runner(graphs: bool) -> ModelRunner:
        pool = KVPool(cfg.num_layers, 512, PS, cfg.num_kv_heads, cfg.head_dim, cuda_model.dtype,
                      "cuda", scratch_pages=1)
        return flashinfer_runner(cuda_model, pool, batch_invariant=True, cuda_graphs=graphs,
                                 max_batch=16, max_verify_rows=16 * 9)

    eager, graphs = runner(False), runner(True)
    prefill, verify = _verify(lengths, drafts)
    eager.forward(prefill)
    graphs.forward(prefill)
    want = eager.forward(verify).clone()
    assert graphs.graphs is not None
    graphs.graphs.eager = None  # compare here, not in the graphs' own first-replay check
    got = graphs.forward(verify).clone()
    assert graphs.graphs.replays == 1
    assert torch.equal(got, want)


def test_greedy_answers_with_speculation_in_graphs_equal_plain_decoding_on_cuda(
    cuda_model: Any,
) -> None:
    from engine import Engine

    text = [100 + (i % 37) for i in range(120)]  # repeats itself: the drafts find matches
    prompts = [text + [200 + i] for i in range(4)]
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    with Engine(model=cuda_model, num_pages=2048) as plain:
        want = [o.token_ids for o in plain.generate(prompts, params)]
    with Engine(model=cuda_model, num_pages=2048, speculation="tree") as spec:
        assert spec.speculation == "tree" and spec.cuda_graphs
        got = [o.token_ids for o in spec.generate(prompts, params)]
        graphs = spec._loop._runner.graphs
        assert graphs is not None and not graphs.retired
    assert got == want
