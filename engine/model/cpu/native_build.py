"""Build a C++ extension once per machine and import it: the native kernels' one loader.

A kernel is compiled on first use with ``-march=native`` into
``~/.cache/radixkv/kernels/<fingerprint>``; the fingerprint hashes the machine
(``machine.machine_key``: CPU model and flags, torch, cores), the compiler flags and the source,
so a build for another CPU or another version of the source is never loaded. Tests also build
the kernels for narrower targets (``march="x86-64-v3"``: AVX2; ``"x86-64"``: no AVX) to run
the paths other machines take on this one. A finished build
is imported directly (torch's loader would rebuild it for every checkout path). When a kernel
cannot be built (no compiler, no headers) the caller gets None and says what it falls back to.

A build is used only once it has proved, on this machine, that a rejected argument surfaces as
a Python ``RuntimeError`` (the caller's ``selftest``: a call with a bad argument). A machine
where the error kills the process instead (a segfault seen on one Xeon, issue 47) must not find
out from a server's request: the first self-test of a build runs in a child process, its verdict
is cached beside the build, and then the test runs again in this process. A build that fails
gets None with a warning naming why, like one that cannot be built.

``RADIXKV_SANITIZE=1`` (``make sanitize``) builds with AddressSanitizer and UBSan into builds of
their own (the flags are in the fingerprint); the process must preload libasan.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import xxhash

from engine.model.cache_root import cache_root
from engine.model.cpu.machine import machine_key

# -fopenmp: the kernels' parallel regions (and at::parallel_for, a header template) need it;
# libgomp resolves to the copy torch already loaded. -ffp-contract=off: the only fused
# multiply-adds are the explicit ones, so every sum is in the order the source writes.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fopenmp")
SANITIZE_ENV = "RADIXKV_SANITIZE"  # "1": AddressSanitizer and UBSan builds (make sanitize)
# Any finding ends the process (UBSan would only print), so a test sees it as a crash.
SANITIZE_FLAGS = (
    "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"
)
SELF_TEST_TIMEOUT_S = 300.0  # importing torch on a loaded machine is slow


def sanitizing() -> bool:
    return os.environ.get(SANITIZE_ENV, "0") == "1"


def cflags(march: str = "native") -> tuple[str, ...]:
    """The compiler flags for instruction set ``march`` (gcc's ``-march`` names)."""
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in CFLAGS)
    return flags + SANITIZE_FLAGS if sanitizing() else flags


def ldflags() -> tuple[str, ...]:
    return ("-fopenmp", "-fsanitize=address,undefined") if sanitizing() else ("-fopenmp",)

_loaded: dict[str, ModuleType | None] = {}
log = logging.getLogger("radixkv.kernels")


def fingerprint(source: Path, march: str = "native") -> str:
    h = xxhash.xxh64()
    for part in (machine_key(), " ".join(cflags(march) + ldflags()), *source_texts(source)):
        h.update(part.encode())
    return h.hexdigest()


def source_texts(source: Path) -> list[str]:
    """The source and every local header it includes (``#include "..."``), recursively: an
    edited header is an edited kernel."""
    texts: list[str] = []
    seen: set[Path] = set()
    todo = [source.resolve()]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        if not path.exists():  # the compiler will say so; the key only needs its name
            texts.append(f"missing {path.name}")
            continue
        text = path.read_text()
        texts.append(text)
        todo.extend((path.parent / inc).resolve() for inc in _INCLUDE.findall(text))
    return texts


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def cache_dir() -> Path:
    return cache_root() / "kernels"


def load_native(
    source: Path, prefix: str, what: str, march: str = "native", selftest: str | None = None
) -> ModuleType | None:
    """The module built from ``source`` for this machine (built on first use), or None with a
    warning naming ``what`` falls back, where it cannot be built here or fails ``selftest``.
    ``march``: build for that instruction set instead of this CPU's own (it must run here).
    ``selftest``: ``"package.module:function"``, a function of the module that returns None
    where a bad call raised RuntimeError, else what happened (see ``expect_rejection``)."""
    key = fingerprint(source, march)
    name = f"{prefix}_{key}"
    if name in _loaded:
        return _loaded[name]
    module: ModuleType | None = None
    build = cache_dir() / key
    built = build / f"{name}.so"
    try:
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
    if module is not None and selftest is not None:
        why = self_test(module, built, selftest)
        if why is not None:
            warnings.warn(
                f"native kernel {source.name} failed its self-test on this machine ({why}); "
                f"{what}",
                RuntimeWarning,
                stacklevel=3,
            )
            module = None
    _loaded[name] = module
    return module


def expect_rejection(call: Callable[[], object], names: str) -> str | None:
    """None where ``call`` raised a RuntimeError whose message names ``names``, else what it
    did instead: the contract every native entry point keeps for a bad argument."""
    try:
        call()
    except RuntimeError as exc:
        return None if names in str(exc) else f"its error does not name {names!r}: {exc}"
    except Exception as exc:  # noqa: BLE001 - the point is to say which
        return f"a bad argument raised {type(exc).__name__}, not RuntimeError: {exc}"
    return f"a bad {names} was accepted"


def self_test(module: ModuleType, built: Path, spec: str) -> str | None:
    """None where ``spec``'s test passes on this machine, else why not. Its first run for a
    build is in a child process (a crash there costs nothing), its verdict cached beside the
    build; then it runs here too, so this process has seen the error surface."""
    test = _resolve(spec)
    key = xxhash.xxh64(f"{spec}\n{inspect.getsource(test)}".encode()).hexdigest()
    verdict_path = built.with_name(f"{built.stem}.selftest-{key}.json")
    verdict: dict[str, object] | None = None
    try:
        verdict = json.loads(verdict_path.read_text())
    except (OSError, ValueError):
        verdict = None
    if verdict is None:
        verdict, conclusive = _self_test_in_child(built, spec)
        if conclusive:
            tmp = verdict_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(verdict))
            os.replace(tmp, verdict_path)
    if not verdict.get("ok"):
        return str(verdict.get("why", "no verdict"))
    return test(module)


def _resolve(spec: str) -> Callable[[ModuleType], str | None]:
    module_name, _, attr = spec.partition(":")
    test = getattr(importlib.import_module(module_name), attr)
    return test  # type: ignore[no-any-return]


def _self_test_in_child(built: Path, spec: str) -> tuple[dict[str, object], bool]:
    """The verdict of ``spec`` on ``built`` in a fresh process, and whether it is one to keep
    (a timeout says nothing about the build)."""
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "engine.model.cpu.native_build", str(built), spec]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=SELF_TEST_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"its test process took over {SELF_TEST_TIMEOUT_S:.0f} s"}, False
    last = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode == 0:
        try:
            return json.loads(last[0]), True
        except ValueError:
            pass
    # Killed by a signal: the verdict to keep. Any other exit (the child could not load the
    # build, say) is not kept: the next process asks again.
    killed = done.returncode < 0
    if killed:
        why = f"a rejected argument killed its test process ({_signal_name(-done.returncode)})"
    else:
        why = f"its test process exited with status {done.returncode}"
    tail = done.stderr.strip().splitlines()[-3:]
    return {"ok": False, "why": why + (": " + " | ".join(tail) if tail else "")}, killed


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _build(name: str, source: Path, build: Path, march: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    build.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(source)],
        extra_cflags=list(cflags(march)),
        extra_ldflags=list(ldflags()),
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


def _child(argv: list[str]) -> int:
    """``python -m engine.model.cpu.native_build <built .so> <spec>``: runs the self-test, prints
    its verdict as one JSON line (a crash prints none: the parent reads the signal)."""
    import torch  # noqa: F401 - loads libc10 and libtorch, which the build links against

    built, spec = Path(argv[0]), argv[1]
    module = _import_built(built.stem, built)
    why = _resolve(spec)(module)
    print(json.dumps({"ok": why is None, "why": why}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
