"""The native kernels' loader: a build is keyed by the machine and the source, reused across
checkouts, and a kernel that cannot be built falls back with a warning."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from engine.model import native_build
from engine.model.attention import native
from engine.model.products import SOURCE as PRODUCTS


def test_a_build_for_another_cpu_or_source_is_never_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The build directory's key changes with the CPU's flags and with the source."""
    key = native_build.fingerprint(PRODUCTS)
    assert key == native_build.fingerprint(PRODUCTS)
    assert key != native_build.fingerprint(native.SOURCE)
    import engine.model.machine as machine

    monkeypatch.setattr(machine, "cpu_info", lambda: ("another CPU", ("fpu", "sse2")))
    other_cpu = native_build.fingerprint(PRODUCTS)
    assert other_cpu != key
    edited = tmp_path / "dense.cpp"
    edited.write_text(PRODUCTS.read_text() + "\n// edited\n")
    assert native_build.fingerprint(edited) not in (key, other_cpu)


def test_a_kernel_that_cannot_be_built_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "exact_attention.cpp"
    broken.write_text("#error this machine cannot build the kernel\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="torch version of exact attention"):
        assert native.load_kernel() is None


def test_a_finished_build_is_imported_without_building_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another checkout (the source at another path) starts warm: no compiler is called."""
    assert native.load_kernel() is not None  # built (or found) once

    def no_build(*args: object) -> ModuleType:
        raise AssertionError("rebuilt an existing kernel")

    monkeypatch.setattr(native_build, "_build", no_build)
    monkeypatch.setattr(native_build, "_loaded", {})
    assert native.load_kernel() is not None
