"""The dtype probe: measured in child processes, remembered, overridable, and a probe that
crashes (as bf16 does on a CPU whose advertised AMX faults) falls back to float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.loader import resolve_dtype
from engine.model.probe import DTYPES, DtypeReport, choose, probe, run_child
from engine.model.rows import RowPadding

SIGILL_CHILD = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"


def test_probe_runs_children_and_remembers_its_decision(tmp_path: Path) -> None:
    calls: list[str] = []

    def counting(dtype: str, limit: float | None) -> DtypeReport | None:
        calls.append(dtype)
        return run_child(dtype, limit)

    first = probe(tmp_path, runner=counting)
    assert first.dtype in DTYPES and calls == ["float32", "bfloat16"]
    assert first.padding(first.dtype) is not None
    assert list(tmp_path.glob("*.json"))

    def must_not_run(dtype: str, limit: float | None) -> DtypeReport | None:
        raise AssertionError("the cached decision should be used")

    again = probe(tmp_path, runner=must_not_run)
    assert again == first


def test_a_crashing_bf16_probe_falls_back_to_float32(tmp_path: Path) -> None:
    assert run_child("bfloat16", None, code=SIGILL_CHILD) is None

    def runner(dtype: str, limit: float | None) -> DtypeReport | None:
        if dtype == "bfloat16":
            return run_child(dtype, limit, code=SIGILL_CHILD)
        return run_child(dtype, limit)

    result = probe(tmp_path, runner=runner)
    assert result.dtype == "float32" and result.reports["bfloat16"] is None


def test_choice_needs_bf16_to_be_faster_and_invariant() -> None:
    pad = RowPadding((4, 8), 12)
    fp32 = DtypeReport(0.02, 0.2, pad)
    assert choose({"float32": fp32, "bfloat16": DtypeReport(0.01, 0.07, pad)}) == "bfloat16"
    assert choose({"float32": fp32, "bfloat16": DtypeReport(0.3, float("inf"), pad)}) == "float32"
    assert choose({"float32": fp32, "bfloat16": DtypeReport(0.01, 0.07, None)}) == "float32"


def test_an_explicit_dtype_overrides_the_probe() -> None:
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype(None, "cpu") == getattr(torch, probe().dtype)


@pytest.mark.parametrize(
    ("padding", "m", "want"),
    [
        (RowPadding((4, 8), 12), 1, 4),
        (RowPadding((4, 8), 12), 5, 8),
        (RowPadding((4, 8), 12), 9, 12),
        (RowPadding((4, 8), 12), 300, 300),
        (RowPadding(), 3, 3),
        (RowPadding((4, 8), 12), 0, 0),
    ],
)
def test_row_padding_rounds_up_to_a_safe_row_count(padding: RowPadding, m: int, want: int) -> None:
    assert padding.pad(m) == want
    x = torch.arange(float(max(m, 1) * 2)).view(-1, 2)[:m]
    padded = padding.pad_rows(x)
    assert padded.shape[0] == want and torch.equal(padded[:m], x)
