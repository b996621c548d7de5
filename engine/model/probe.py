"""Which dtype is fastest on this CPU, and how to keep its matrix products batch-invariant.

Machines differ: a bf16 product runs ~3x faster than fp32 on an AMD EPYC with AVX-512 BF16,
~70x slower on one without it (a plain loop), and kills the process with SIGILL on an Intel
Xeon whose advertised AMX faults. So the engine measures instead of guessing: a child process
per dtype times a few decoder layers' products at a decode and a prefill shape and measures the
row padding that makes them batch-invariant (``engine.model.rows``). A crash, a timeout or a dtype
whose products cannot be made invariant rules that dtype out. The result is remembered per CPU
model and torch version in the user's cache directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.model.rows import RowPadding

DTYPES = ("float32", "bfloat16")
# bf16 is chosen only when it is at least this much faster (geometric mean of both shapes).
MIN_SPEEDUP = 1.1
PROBE_TIMEOUT_S = 180
SLOW_FACTOR = 3.0  # a dtype this much slower than float32 at decode is not probed further
# SmolLM2-135M's per-layer products (K, N): fused qkv, o, fused gate/up, down.
LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
PROBE_LAYERS = 8  # ~100 MB of fp32 weights: more than a last-level cache, as in a real step
DECODE_ROWS, PREFILL_ROWS = 8, 256

_CHILD = (
    "import json, engine.model.probe as p; "
    "print(json.dumps(p.measure_in_process({dtype!r}, {limit_s!r})))"
)


@dataclass(frozen=True)
class DtypeReport:
    """One dtype's probe: seconds per pass at each shape and the invariant row padding."""

    decode_s: float
    prefill_s: float
    padding: RowPadding | None  # None: its products cannot be made batch-invariant

    def to_json(self) -> dict[str, object]:
        return {
            "decode_s": self.decode_s,
            "prefill_s": self.prefill_s,
            "padding": None if self.padding is None else self.padding.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> DtypeReport:
        padding = data["padding"]
        if padding is not None and not isinstance(padding, dict):
            raise ValueError(f"probe: malformed padding {padding!r}")
        return cls(
            float(data["decode_s"]),  # type: ignore[arg-type]
            float(data["prefill_s"]),  # type: ignore[arg-type]
            None if padding is None else RowPadding.from_json(padding),
        )


@dataclass(frozen=True)
class ProbeResult:
    dtype: str  # the choice: "float32" or "bfloat16"
    reports: dict[str, DtypeReport | None] = field(default_factory=dict)  # None: crashed

    def padding(self, dtype: str) -> RowPadding | None:
        report = self.reports.get(dtype)
        return report.padding if report is not None else None


def measure_in_process(dtype: str, limit_s: float | None = None) -> dict[str, object]:
    """Time and check ``dtype``'s products here (run in a child: it may crash). A decode pass
    slower than ``limit_s`` ends the probe early (``too_slow``: no need to measure more)."""
    from engine.model import rows

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(k, n, generator=gen).to(dt)
        for _ in range(PROBE_LAYERS)
        for k, n in LAYER_SHAPES
    ]

    def timed(m: int, threads: int) -> float:
        torch.set_num_threads(threads)
        xs = {k: torch.randn(m, k, generator=gen).to(dt) for k, _ in LAYER_SHAPES}
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for w in weights:
                torch.matmul(xs[w.shape[0]], w)
            best = min(best, time.perf_counter() - t)
        return best

    cores = os.cpu_count() or 1
    decode_s = timed(DECODE_ROWS, 1)
    threads = tuple(sorted({1, cores}))
    if limit_s is not None and decode_s > limit_s:
        # Not a candidate for speed; its padding is still measured (cheaply), so that an
        # explicit dtype= of it is exact too.
        padding = rows.measure(
            dt, threads=threads, shapes=LAYER_SHAPES[:1] + ((64, 64),), up_to=16, large=(65, 257)
        )
        return DtypeReport(decode_s, float("inf"), padding).to_json()
    prefill_s = timed(PREFILL_ROWS, cores)
    return DtypeReport(decode_s, prefill_s, rows.measure(dt, threads=threads)).to_json()

def run_child(dtype: str, limit_s: float | None = None, code: str = _CHILD) -> DtypeReport | None:
    """``measure_in_process(dtype)`` in a child process; None if it crashes or hangs."""
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
    """bfloat16 when it ran, can be made invariant and is ``MIN_SPEEDUP`` faster; else fp32."""
    fp32, bf16 = reports.get("float32"), reports.get("bfloat16")
    if bf16 is None or bf16.padding is None:
        return "float32"
    if fp32 is None:
        return "bfloat16"
    ratio = (fp32.decode_s / bf16.decode_s * fp32.prefill_s / bf16.prefill_s) ** 0.5
    return "bfloat16" if ratio >= MIN_SPEEDUP else "float32"


def machine_key() -> str:
    """CPU model, its flags and torch's version: what the probe's answer depends on."""
    import xxhash

    name, flags = "unknown", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == "unknown":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    text = f"{name}|{flags}|{torch.__version__}|{os.cpu_count()}"
    return xxhash.xxh64(text.encode()).hexdigest()


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
        from engine.model.loader import cache_root

        cache_dir = cache_root() / "probe"
    path = cache_dir / f"{machine_key()}.json"
    try:
        return _from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    # float32 first: a dtype whose decode pass is far slower than float32's stops early.
    fp32 = runner("float32", None)
    limit = None if fp32 is None else SLOW_FACTOR * fp32.decode_s
    reports = {"float32": fp32, "bfloat16": runner("bfloat16", limit)}
    result = ProbeResult(choose(reports), reports)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_to_json(result), indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: probe again next time
    return result


def main() -> None:
    result = probe()
    print(json.dumps(_to_json(result), indent=1))


if __name__ == "__main__":
    main()
