"""The dtype probe: measured in child processes on the real forward, remembered,
overridable; a probe that crashes (as bf16 does on a CPU whose advertised AMX faults) falls
back to float32, and a forward that is not batch-invariant is found and not chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.bringup import invariance
from engine.model.bringup.dtype_probe import (
    DTYPES,
    DtypeReport,
    ProbeResult,
    choose,
    describe,
    probe,
    run_child,
)
from engine.model.bringup.load import resolve_dtype
from engine.model.cpu.products import PackedWeight

SIGILL_CHILD = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"


def test_probe_runs_children_and_remembers_its_decision(tmp_path: Path) -> None:
    calls: list[str] = []

    def counting(dtype: str, limit: float | None) -> DtypeReport | None:
        calls.append(dtype)
        return run_child(dtype, limit)

    first = probe(tmp_path, runner=counting)
    assert first.dtype in DTYPES and calls == ["float32", "bfloat16"]
    assert first.verified(first.dtype)
    assert list(tmp_path.glob("*.json"))

    def must_not_run(dtype: str, limit: float | None) -> DtypeReport | None:
        raise AssertionError("the cached decision should be used")

    again = probe(tmp_path, runner=must_not_run)
    assert again == first


def test_a_verdict_reached_without_the_native_kernels_is_not_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that failed to load once (a broken build, a failed self-test) must not leave
    a not-invariant verdict under its sources' key for every later engine."""
    from engine.model.bringup import dtype_probe as probe_module

    def torch_fallback(dtype: str, limit: float | None) -> DtypeReport | None:
        return DtypeReport(0.1, 1.0, False, 0.0, ("chunked, 1 threads",))

    monkeypatch.setattr(probe_module, "kernels_loaded", lambda: False)
    found = probe(tmp_path, runner=torch_fallback)
    assert not found.verified("float32")
    assert not list(tmp_path.glob("*.json"))


def test_a_child_that_ran_on_torchs_fallback_is_not_remembered(tmp_path: Path) -> None:
    """The parent's kernels load, but a child's did not (its report says so): a bf16 timed on
    the fallback (50x slow) must not pin float32 for every later engine."""

    def fallback_child(dtype: str, limit: float | None) -> DtypeReport | None:
        slow = dtype == "bfloat16"
        return DtypeReport(1.8 if slow else 0.03, 1.0, True, 0.0, (), True, native=not slow)

    found = probe(tmp_path, runner=fallback_child)
    assert found.dtype == "float32"
    assert not list(tmp_path.glob("*.json"))


def test_a_crashing_bf16_probe_falls_back_to_float32(tmp_path: Path) -> None:
    assert run_child("bfloat16", None, code=SIGILL_CHILD) is None

    def runner(dtype: str, limit: float | None) -> DtypeReport | None:
        if dtype == "bfloat16":
            return run_child(dtype, limit, code=SIGILL_CHILD)
        return run_child(dtype, limit)

    result = probe(tmp_path, runner=runner)
    assert result.dtype == "float32" and result.reports["bfloat16"] is None


def test_choice_needs_bf16_to_be_faster_invariant_and_accurate() -> None:
    fp32 = DtypeReport(0.02, 0.2, True)
    assert choose({"float32": fp32, "bfloat16": DtypeReport(0.01, 0.07, True)}) == "bfloat16"
    assert choose({"float32": fp32, "bfloat16": DtypeReport(0.3, float("inf"), True)}) == "float32"
    broken = DtypeReport(0.01, 0.07, False, failed=("chunked, 2 threads",))
    assert choose({"float32": fp32, "bfloat16": broken}) == "float32"
    wrong = DtypeReport(0.01, 0.07, True, error=0.5, accurate=False)
    assert choose({"float32": fp32, "bfloat16": wrong}) == "float32"
    lines = describe(ProbeResult("float32", {"float32": fp32, "bfloat16": broken}))
    assert "NOT invariant (chunked, 2 threads)" in lines[1] and lines[-1] == "chosen: float32"


def test_the_check_finds_a_product_that_depends_on_the_rows_beside_it(
    loaded_fp32: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real forward with our products is invariant; inject a product whose rows shift
    with the row count of the call (what a vendor BLAS does when it changes kernels) and the
    check names the cases that broke."""
    assert invariance.check(loaded_fp32).invariant  # type: ignore[arg-type]
    real = PackedWeight.__call__

    def row_count_dependent(self: PackedWeight, x: torch.Tensor, *args: object, **kw: object):
        y = real(self, x, *args, **kw)  # type: ignore[arg-type]
        return y + 1e-6 * (x.shape[0] % 3)

    monkeypatch.setattr(PackedWeight, "__call__", row_count_dependent)
    report = invariance.check(loaded_fp32)  # type: ignore[arg-type]
    assert not report.invariant
    assert any("chunked" in f for f in report.failed)
    assert any("batched" in f for f in report.failed)


def test_an_explicit_dtype_overrides_the_probe() -> None:
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype(None, "cpu") == getattr(torch, probe().dtype)
