"""How many CPU threads a forward pass gets: the team for big batches, one for small ones."""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

# Batches of at least this many tokens run on every thread: a prefill-sized product gains
# from a thread team, but a decode step is a few thousand small ops, and synchronising a team
# per op costs more than it splits (``python -m workloads.model_bench --threads N`` measures
# both sides; docs/benchmarks.md has the figures).
PARALLEL_MIN_TOKENS = 128
# torch's thread count as the process started (its default: the machine's cores), read before
# any pass lowers it: a policy made after a decode step would otherwise get that step's one.
STARTING_THREADS = torch.get_num_threads()
CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD", or "max PERIOD"


def cores_granted(cpu_max: str = CPU_MAX) -> int | None:
    """The cores this process may use: the CPUs it may run on, fewer where a cgroup quota
    (``docker --cpus``, a Kubernetes limit) grants less time than that; None where unknown.

    A thread beyond them never runs at the same time as the others, so a call split over it
    waits for the scheduler to give it a turn."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count()
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores or 1 << 30, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


@dataclass(frozen=True)
class ThreadPolicy:
    """Intra-op threads per forward pass on the CPU: ``max_threads`` for batches of at least
    ``parallel_min_tokens`` tokens (prefill chunks), one thread below that (decode steps)."""

    max_threads: int
    parallel_min_tokens: int = PARALLEL_MIN_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.max_threads, int) or self.max_threads < 1:
            raise ValueError(f"threads: must be an int >= 1, got {self.max_threads!r}")
        if self.parallel_min_tokens < 1:
            raise ValueError(
                f"parallel_min_tokens: must be >= 1, got {self.parallel_min_tokens!r}"
            )

    @classmethod
    def default(cls, threads: int | None) -> ThreadPolicy:
        """``threads`` at most; None: torch's thread count when this module was imported
        (its default, the machine's cores, unless the caller set it before), but no more than
        the cores the process is granted (``cores_granted``)."""
        if threads is not None:
            return cls(threads)
        return cls(max(1, min(STARTING_THREADS, cores_granted() or STARTING_THREADS)))

    def threads_for(self, num_tokens: int) -> int:
        return self.max_threads if num_tokens >= self.parallel_min_tokens else 1

    def apply(self, num_tokens: int) -> None:
        """Set torch's intra-op threads for a pass of ``num_tokens`` tokens, on the calling
        thread (the engine loop); a no-op when it is already right."""
        want = self.threads_for(num_tokens)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)


# omp_pause_resource_all's "soft" kind (OpenMP 5.0): the calling thread's idle team is freed.
OMP_PAUSE_SOFT = 1


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """torch's OpenMP runtime (the copy our kernels resolve to), where it has one we can call."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for pattern in ("libgomp*.so*", "libiomp5*.so*", "libomp*.so*", "libomp*.dylib"):
        for path in sorted(lib_dir.glob(pattern)):
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                return lib
    return None


def release_openmp_team() -> bool:
    """Free the calling thread's idle OpenMP worker threads; True if they were.

    Each thread that opens a parallel region keeps its own team of workers. Once the caller's
    thread (which loaded the model) and the engine loop both hold a team, libgomp counts more
    threads than cores and lets its workers spin only briefly before sleeping, so every small
    parallel region of a step waits for a worker to wake (a decode pass on the loop thread ran
    far slower than the same pass on the caller's: ``workloads.model_bench`` shows it). The
    engine frees the constructing thread's team, and the loop frees its own whenever it goes
    idle (several engines in one process: only the busy ones hold teams). A later region on
    the thread builds a new team, once."""
    lib = _openmp_runtime()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
