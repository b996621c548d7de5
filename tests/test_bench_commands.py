"""The bench commands under the names the team's docs give (``python -m engine.bench``,
``python -m radix.bench``) run the benches in ``workloads``, and importing them as modules
brings in nothing above the library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench import split_device

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_radix_bench_runs_the_tree_bench() -> None:
    done = run("-m", "radix.bench", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: python -m workloads.tree_bench" in done.stdout


def test_engine_bench_runs_the_cpu_model_bench_with_its_arguments() -> None:
    done = run("-m", "engine.bench", "--device", "cpu", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: python -m workloads.model_bench" in done.stdout
    assert "--verify-rows" in done.stdout


def test_importing_the_aliases_imports_no_bench() -> None:
    code = ("import sys, radix.bench, engine.bench; "
            "assert not [m for m in sys.modules if m.startswith('workloads')]")
    done = run("-c", code)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("argv", "cuda", "want"),
    [
        ([], False, ("cpu", [])),
        ([], True, ("cuda", [])),
        (["--device", "cpu", "--repeats", "3"], True, ("cpu", ["--repeats", "3"])),
        (["--repeats", "3", "--device=cuda"], False, ("cuda", ["--repeats", "3"])),
    ],
)
def test_the_device_defaults_to_cuda_where_there_is_one(
    argv: list[str], cuda: bool, want: tuple[str, list[str]]
) -> None:
    assert split_device(argv, cuda) == want


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--device"]])
def test_an_unknown_device_is_refused_by_name(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="--device must be cpu or cuda"):
        split_device(argv, False)
