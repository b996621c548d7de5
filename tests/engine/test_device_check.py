"""The start-up check a CUDA engine runs on its own runner, exercised on the CPU through
FlashInfer's reference with decode graphs (uncaptured): it passes on an invariant forward,
names the cases where an injected batch-dependent attention differs, and says so when the
pool cannot hold it, never silently."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flashinfer_cases import flashinfer_runner

from engine.model.bringup.device_check import cases, check_runner, verify_on_device
from engine.model.kv_pool import KVPool
from engine.model.runner import ModelRunner

PS = 16


def _runner(loaded: Any, pages: int = 120, graphs: bool = True) -> ModelRunner:
    cfg = loaded.config
    pool = KVPool(cfg.num_layers, pages, PS, cfg.num_kv_heads, cfg.head_dim, scratch_pages=1)
    return flashinfer_runner(loaded, pool, batch_invariant=True,
                             cuda_graphs=graphs, max_batch=8)


def test_the_check_covers_decode_graph_buckets_and_mixed_passes() -> None:
    found = cases()
    widths = {name: len(pieces) for name, pieces in found.items()}
    assert widths["decoded alone"] == 1
    assert widths["decoded in a batch of 3"] == 3  # padded to the bucket of 4
    assert widths["decoded in a batch of 6"] == 6  # padded to 8
    # every request's last chunks are one token in the decode cases
    assert all(len(c) == 1 for c in found["decoded in a batch of 3"][1][1:])


def test_an_invariant_forward_passes_with_its_decodes_in_graphs(loaded_fp32: Any) -> None:
    runner = _runner(loaded_fp32)
    assert runner.graphs is not None
    report = check_runner(runner)
    assert report is not None and report.invariant, report
    assert runner.graphs.replays > 0  # the decode cases ran in the graphs
    assert verify_on_device(runner)


class _BatchDependent:
    """Wraps a backend: the attention output scaled by a factor that depends on how many
    tokens share the pass, as a kernel whose reduction order follows the batch would."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tokens = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def plan(self, fb: Any) -> None:
        self.tokens = fb.num_tokens
        self.inner.plan(fb)

    def run_qkv(self, layer: int, qkv: torch.Tensor, rope: Any, pool: Any) -> torch.Tensor:
        out = type(self.inner).run_qkv(self, layer, qkv, rope, pool)
        return out * (1.0 + 1e-4 * self.tokens)

    def run(self, *args: Any) -> torch.Tensor:
        return self.inner.run(*args)


def test_a_batch_dependent_attention_fails_the_check_and_says_which_cases(
    loaded_fp32: Any,
) -> None:
    runner = _runner(loaded_fp32, graphs=False)
    runner.backend = _BatchDependent(runner.backend)  # type: ignore[assignment]
    report = check_runner(runner)
    assert report is not None and not report.invariant
    assert "beside prefills" in report.failed and "batched whole" in report.failed
    with pytest.warns(RuntimeWarning, match="not verified .*logits differ.*batch_invariant=False"):
        assert not verify_on_device(runner)


def test_a_pool_too_small_for_the_check_is_reported_not_passed(loaded_fp32: Any) -> None:
    runner = _runner(loaded_fp32, pages=20, graphs=False)
    assert check_runner(runner) is None
    with pytest.warns(RuntimeWarning, match="too small"):
        assert not verify_on_device(runner)


def test_a_runner_not_asked_to_be_invariant_is_not_checked(loaded_fp32: Any) -> None:
    cfg = loaded_fp32.config
    pool = KVPool(cfg.num_layers, 120, PS, cfg.num_kv_heads, cfg.head_dim)
    runner = flashinfer_runner(loaded_fp32, pool, batch_invariant=False)
    assert not runner.batch_invariant
    assert not verify_on_device(runner)


def test_an_engine_on_flashinfers_path_reports_the_invariance_its_check_found(
    make_engine: Any, caplog: Any
) -> None:
    """The start-up check runs on the engine's own runner and its verdict reaches
    ``Engine.batch_invariant``, ``stats()`` and the log (the reference's path on the CPU)."""
    import logging

    with caplog.at_level(logging.INFO, logger="radixkv.engine"):
        eng = make_engine(page_size=16, num_pages=120, backend="flashinfer")
    assert eng.batch_invariant and eng.stats().batch_invariant
    assert not eng.cuda_graphs  # graphs are captured on CUDA only
    assert "batch_invariant: verified" in caplog.text
    assert "batch_invariant=True" in caplog.text
    off = make_engine(page_size=16, num_pages=120, backend="flashinfer", batch_invariant=False)
    assert not off.batch_invariant and not off.stats().batch_invariant


class _GraphRowsDiffer:
    """Wraps a decode graphs' forward: its rows come out nudged, as a graph whose padding
    changed the kernel's tiling would."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, fb: Any, attention: Any) -> torch.Tensor:
        return self.forward(fb, attention) * (1.0 + 1e-4)


def test_a_graph_bucket_whose_first_replay_differs_is_retired_and_its_passes_run_eagerly(
    loaded_fp32: Any,
) -> None:
    runner = _runner(loaded_fp32)
    assert runner.graphs is not None
    runner.graphs.forward = _GraphRowsDiffer(runner.graphs.forward)
    with pytest.warns(RuntimeWarning, match="graph of 4 entries and 4 rows .* differ"):
        assert verify_on_device(runner)
    # the buckets of the check's decodes: alone, and padded from 3 and 6 entries
    assert runner.graphs.retired == {(1, 1), (4, 4), (8, 8)}
    replays = runner.graphs.replays
    report = check_runner(runner)
    assert report is not None and report.invariant
    assert runner.graphs.replays == replays  # their passes ran eagerly


def test_graphs_that_differ_past_their_first_replay_are_dropped_by_the_start_up_check(
    loaded_fp32: Any,
) -> None:
    runner = _runner(loaded_fp32)
    assert runner.graphs is not None
    runner.graphs.eager = None  # no first-replay comparison: the start-up check is the net
    runner.graphs.forward = _GraphRowsDiffer(runner.graphs.forward)
    with pytest.warns(RuntimeWarning, match="decode graphs .* differ from eager passes"):
        assert verify_on_device(runner)
    assert runner.graphs is None  # decode runs eagerly from now on
    report = check_runner(runner)
    assert report is not None and report.invariant


def test_a_forward_not_invariant_without_graphs_either_keeps_its_graphs_and_fails(
    loaded_fp32: Any,
) -> None:
    runner = _runner(loaded_fp32)
    runner.backend = _BatchDependent(runner.backend)  # type: ignore[assignment]
    with pytest.warns(RuntimeWarning, match="batch_invariant=False"):
        assert not verify_on_device(runner)
    assert runner.graphs is not None  # no exactness to buy by giving up their speed


def test_a_capture_that_fails_leaves_a_runner_that_decodes_eagerly(
    loaded_fp32: Any, monkeypatch: Any
) -> None:
    import engine.model.cuda.platform as cuda_platform

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_platform, "DecodeGraphs", failing)
    with pytest.warns(RuntimeWarning, match="capturing the decode graphs failed.*eagerly"):
        runner = _runner(loaded_fp32)
    assert runner.graphs is None
    assert verify_on_device(runner)
