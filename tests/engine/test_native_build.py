"""The native kernels' loader: a build is keyed by the machine and the source, reused across
checkouts, and a kernel that cannot be built falls back with a warning."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import pytest

from engine.model.cpu import exact_attention, native_build
from engine.model.cpu.products import SOURCE as PRODUCTS


def test_a_build_for_another_cpu_or_source_is_never_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The build directory's key changes with the CPU's flags and with the source."""
    key = native_build.fingerprint(PRODUCTS)
    assert key == native_build.fingerprint(PRODUCTS)
    assert key != native_build.fingerprint(exact_attention.SOURCE)
    import engine.model.cpu.machine as machine

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
    monkeypatch.setattr(exact_attention, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="torch version of exact attention"):
        assert exact_attention.load_kernel() is None


def test_a_finished_build_is_imported_without_building_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another checkout (the source at another path) starts warm: no compiler is called."""
    assert exact_attention.load_kernel() is not None  # built (or found) once

    def no_build(*args: object) -> ModuleType:
        raise AssertionError("rebuilt an existing kernel")

    monkeypatch.setattr(native_build, "_build", no_build)
    monkeypatch.setattr(native_build, "_loaded", {})
    assert exact_attention.load_kernel() is not None


SELF_TESTS = '''
import os
import signal


def crashes(kernel):
    os.kill(os.getpid(), signal.SIGSEGV)


def accepts_the_bad_argument(kernel):
    return "a bad slot was accepted"
'''


@pytest.fixture()
def cache_with_the_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A cache of its own holding this machine's attention build (no verdicts), and a module
    of fake self-tests importable here and in the child."""
    assert exact_attention.load_kernel() is not None  # built (or found) in the real cache
    key = native_build.fingerprint(exact_attention.SOURCE)
    built = native_build.cache_dir() / key / f"radixkv_exact_{key}.so"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (native_build.cache_dir() / key).mkdir(parents=True)
    shutil.copy2(built, native_build.cache_dir() / key / built.name)
    (tmp_path / "fake_native_selftests.py").write_text(SELF_TESTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", {})
    return native_build.cache_dir() / key


def test_a_build_whose_rejected_argument_kills_the_process_is_not_used(
    monkeypatch: pytest.MonkeyPatch, cache_with_the_build: Path
) -> None:
    """The first self-test runs in a child: its crash is a verdict (cached beside the build,
    naming the signal), a warning and the fallback; this process never runs the test."""
    def load() -> ModuleType | None:
        return native_build.load_native(
            exact_attention.SOURCE, "radixkv_exact", "the fallback runs",
            selftest="fake_native_selftests:crashes",
        )

    with pytest.warns(RuntimeWarning, match="killed its test process.*SIGSEGV.*the fallback runs"):
        assert load() is None
    assert len(list(cache_with_the_build.glob("*.selftest-*.json"))) == 1

    def no_child(*args: object) -> object:
        raise AssertionError("the cached verdict was not used")

    monkeypatch.setattr(native_build, "_self_test_in_child", no_child)
    monkeypatch.setattr(native_build, "_loaded", {})
    with pytest.warns(RuntimeWarning, match="SIGSEGV"):
        assert load() is None


def test_a_build_that_accepts_a_bad_argument_is_not_used(cache_with_the_build: Path) -> None:
    with pytest.warns(RuntimeWarning, match="a bad slot was accepted"):
        assert native_build.load_native(
            exact_attention.SOURCE, "radixkv_exact", "the fallback runs",
            selftest="fake_native_selftests:accepts_the_bad_argument",
        ) is None


def test_the_kernels_pass_their_self_tests_here_and_keep_the_verdict() -> None:
    """This machine's builds raise RuntimeError for a bad slot, page id and weight (in a
    child, then in this process), and the verdict sits beside each build."""
    from engine.model.cpu.products import load_products, rejects_a_weight_that_does_not_fit

    kernel, products = exact_attention.load_kernel(), load_products()
    assert kernel is not None and products is not None
    assert exact_attention.rejects_bad_slots_and_pages(kernel) is None
    assert rejects_a_weight_that_does_not_fit(products) is None
    for source in (exact_attention.SOURCE, PRODUCTS):
        build = native_build.cache_dir() / native_build.fingerprint(source)
        verdicts = [p.read_text() for p in build.glob("*.selftest-*.json")]
        assert '{"ok": true, "why": null}' in verdicts


def test_an_edited_header_is_an_edited_kernel(tmp_path: Path) -> None:
    """The fingerprint covers the headers a source includes (guard.h)."""
    (tmp_path / "k.cpp").write_text('#include "h.h"\n')
    (tmp_path / "h.h").write_text("// one\n")
    before = native_build.fingerprint(tmp_path / "k.cpp")
    (tmp_path / "h.h").write_text("// two\n")
    assert native_build.fingerprint(tmp_path / "k.cpp") != before
