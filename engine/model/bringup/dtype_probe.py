"""Which dtype is fastest on this CPU, and whether the engine's forward is invariant in it.

Machines differ: bf16 is several times faster than fp32 on a CPU with AVX-512 BF16, many
times slower in torch on one without it, and killed the process with SIGILL on an Intel Xeon
whose advertised AMX faults; a vendor BLAS that passed a probe of plain products broke the
model's invariance at shapes the probe never tried (figures: docs/benchmarks.md). So the engine measures instead of guessing: a
child process per dtype loads the real model, times the engine's own forward at a decode and a
prefill shape, and checks that forward for batch invariance (``invariance``). A
crash, a timeout, a forward that is not invariant, or one too far from float32 rules that
dtype out. The result is remembered per machine (CPU model, flags, cores, torch) and version
of the kernels, in the user's cache directory.

This module is the verdict (run the children, choose, remember); what a child runs is
``dtype_probe_child``, which loads the model the way ``load`` does when it consults the verdict
here (``python -m engine.model.bringup.dtype_probe`` prints it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.model.cache_root import cache_root
from engine.model.cpu.kernels import kernels_key, kernels_loaded
from engine.model.cpu.machine import machine_key

DTYPES = ("float32", "bfloat16")
# bf16 is chosen only when it is at least this much faster (geometric mean of both shapes).
MIN_SPEEDUP = 1.1
PROBE_TIMEOUT_S = 300
SLOW_FACTOR = 3.0  # a dtype this much slower than float32 at decode is not timed further

# The child runs the measurement (dtype_probe_child, which loads the model: it sits above the
# load, which asks this module for its "auto" dtype).
_CHILD = (
    "import json, engine.model.bringup.dtype_probe_child as c; "
    "print(json.dumps(c.measure_in_process({dtype!r}, {limit_s!r})))"
)


@dataclass(frozen=True)
class DtypeReport:
    """One dtype's probe: seconds per decode step and per prefill pass of the real forward,
    whether that forward was invariant, and its error against float32."""

    decode_s: float
    prefill_s: float
    invariant: bool
    error: float = 0.0
    failed: tuple[str, ...] = ()  # the invariance cases that differed
    accurate: bool = True  # error within invariance.TOLERANCE
    # The child's forward ran our products and attention kernel (False: torch's fallback, a
    # kernel that did not load there; such a report is not remembered)
    native: bool = True

    @property
    def usable(self) -> bool:
        return self.invariant and self.accurate

    def to_json(self) -> dict[str, object]:
        return {
            "decode_s": self.decode_s,
            "prefill_s": self.prefill_s,
            "invariant": self.invariant,
            "error": self.error,
            "failed": list(self.failed),
            "accurate": self.accurate,
            "native": self.native,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> DtypeReport:
        failed = data.get("failed", [])
        if not isinstance(failed, list):
            raise ValueError(f"probe: malformed failed {failed!r}")
        return cls(
            float(data["decode_s"]),  # type: ignore[arg-type]
            float(data["prefill_s"]),  # type: ignore[arg-type]
            bool(data["invariant"]),
            float(data.get("error", 0.0)),  # type: ignore[arg-type]
            tuple(str(f) for f in failed),
            bool(data.get("accurate", True)),
            bool(data.get("native", True)),
        )


@dataclass(frozen=True)
class ProbeResult:
    dtype: str  # the choice: "float32" or "bfloat16"
    reports: dict[str, DtypeReport | None] = field(default_factory=dict)  # None: crashed

    def verified(self, dtype: str) -> bool:
        """The engine's forward in ``dtype`` was checked invariant and accurate here."""
        report = self.reports.get(dtype)
        return report is not None and report.usable


def run_child(dtype: str, limit_s: float | None = None, code: str = _CHILD) -> DtypeReport | None:
    """``dtype_probe_child.measure_in_process(dtype)`` in a child process; None if it crashes or
    hangs."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code.format(dtype=dtype, limit_s=limit_s)],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    try:
        return DtypeReport.from_json(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def choose(reports: dict[str, DtypeReport | None]) -> str:
    """bfloat16 when it ran, its forward was verified invariant and accurate, and it is
    ``MIN_SPEEDUP`` faster; else float32."""
    fp32, bf16 = reports.get("float32"), reports.get("bfloat16")
    if bf16 is None or not bf16.usable:
        return "float32"
    if fp32 is None:
        return "bfloat16"
    ratio = (fp32.decode_s / bf16.decode_s * fp32.prefill_s / bf16.prefill_s) ** 0.5
    return "bfloat16" if ratio >= MIN_SPEEDUP else "float32"


def _to_json(result: ProbeResult) -> dict[str, object]:
    reports = {name: None if r is None else r.to_json() for name, r in result.reports.items()}
    return {"dtype": result.dtype, "reports": reports, "torch": torch.__version__}


def _from_json(data: dict[str, object]) -> ProbeResult:
    raw = data["reports"]
    if not isinstance(raw, dict):
        raise ValueError("probe cache: reports is not a mapping")
    reports = {name: None if r is None else DtypeReport.from_json(r) for name, r in raw.items()}
    dtype = data["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"probe cache: unknown dtype {dtype!r}")
    return ProbeResult(str(dtype), reports)


def probe(
    cache_dir: Path | None = None,
    runner: Callable[[str, float | None], DtypeReport | None] = run_child,
) -> ProbeResult:
    """The remembered probe for this machine, or a new one (seconds) that is then saved."""
    if cache_dir is None:
        cache_dir = cache_root() / "probe"
    path = cache_dir / f"{machine_key()}-{kernels_key()}.json"
    try:
        return _from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    # float32 first: a dtype whose decode pass is far slower than float32's stops early.
    fp32 = runner("float32", None)
    limit = None if fp32 is None else SLOW_FACTOR * fp32.decode_s
    reports = {"float32": fp32, "bfloat16": runner("bfloat16", limit)}
    result = ProbeResult(choose(reports), reports)
    if not kernels_loaded() or any(r is not None and not r.native for r in reports.values()):
        # A verdict on torch's fallback (a kernel that did not build, or failed its self-test
        # this time, here or in a child) is not kept: the key names the kernels' sources, not
        # whether they loaded (a child on the fallback timed bf16 50x slow, and float32 stuck).
        return result
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_to_json(result), indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: probe again next time
    return result


def describe(result: ProbeResult) -> list[str]:
    """One line per dtype for people: speed, invariance, error, and the choice."""
    lines = []
    for name in DTYPES:
        r = result.reports.get(name)
        if r is None:
            lines.append(f"{name}: crashed or timed out in its probe: not usable here")
            continue
        verdict = "invariant" if r.invariant else f"NOT invariant ({', '.join(r.failed)})"
        accuracy = "" if r.accurate else " (too far from float32)"
        lines.append(
            f"{name}: decode step {r.decode_s * 1e3:.1f} ms, prefill pass {r.prefill_s * 1e3:.1f} "
            f"ms, {verdict}, error vs float32 {r.error:.2e}{accuracy}"
        )
    lines.append(f"chosen: {result.dtype}")
    return lines


def main() -> None:
    result = probe()
    print(json.dumps(_to_json(result), indent=1))
    for line in describe(result):
        print(line)


if __name__ == "__main__":
    main()
