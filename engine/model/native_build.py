"""Build a C++ extension once per machine and import it: the native kernels' one loader.

A kernel is compiled on first use with ``-march=native`` into
``~/.cache/radixkv/kernels/<fingerprint>``; the fingerprint hashes the machine
(``machine.machine_key``: CPU model and flags, torch, cores), the compiler flags and the source,
so a build for another CPU or another version of the source is never loaded. Tests also build
the kernels for narrower targets (``march="x86-64-v3"``: AVX2; ``"x86-64"``: no AVX) to run
the paths other machines take on this one. A finished build
is imported directly (torch's loader would rebuild it for every checkout path). When a kernel
cannot be built (no compiler, no headers) the caller gets None and says what it falls back to.
"""

from __future__ import annotations

import importlib.util
import logging
import time
import warnings
from pathlib import Path
from types import ModuleType

import xxhash

from engine.model.machine import cache_root, machine_key

# -fopenmp: the kernels' parallel regions (and at::parallel_for, a header template) need it;
# libgomp resolves to the copy torch already loaded. -ffp-contract=off: the only fused
# multiply-adds are the explicit ones, so every sum is in the order the source writes.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fopenmp")


def cflags(march: str = "native") -> tuple[str, ...]:
    """The compiler flags for instruction set ``march`` (gcc's ``-march`` names)."""
    return tuple(f"-march={march}" if f == "-march=native" else f for f in CFLAGS)

_loaded: dict[str, ModuleType | None] = {}
log = logging.getLogger("radixkv.kernels")


def fingerprint(source: Path, march: str = "native") -> str:
    h = xxhash.xxh64()
    for part in (machine_key(), " ".join(cflags(march)), source.read_text()):
        h.update(part.encode())
    return h.hexdigest()


def cache_dir() -> Path:
    return cache_root() / "kernels"


def load_native(
    source: Path, prefix: str, what: str, march: str = "native"
) -> ModuleType | None:
    """The module built from ``source`` for this machine (built on first use), or None with a
    warning naming ``what`` falls back, where it cannot be built here. ``march``: build for
    that instruction set instead of this CPU's own (it must run here)."""
    key = fingerprint(source, march)
    name = f"{prefix}_{key}"
    if name in _loaded:
        return _loaded[name]
    module: ModuleType | None = None
    build = cache_dir() / key
    try:
        built = build / f"{name}.so"
        if built.exists():
            module = _import_built(name, built)
        else:
            start = time.perf_counter()
            module = _build(name, source, build, march)
            seconds = time.perf_counter() - start
            log.info("built %s for this machine in %.0f s", source.name, seconds)
    except Exception as exc:  # a missing compiler or headers
        warnings.warn(
            f"native kernel {source.name} could not be built ({type(exc).__name__}: {exc}); "
            f"{what}",
            RuntimeWarning,
            stacklevel=3,
        )
    _loaded[name] = module
    return module


def _build(name: str, source: Path, build: Path, march: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    build.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(source)],
        extra_cflags=list(cflags(march)),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )


def _import_built(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
