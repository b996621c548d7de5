"""What the engine knows of the machine it runs on: its CPU and its memory.

One place for what several modules key or size things by: the dtype probe's cache and the
kernels' builds are keyed by ``machine_key`` (CPU model, flags, cores, torch), the disk tier's
store by it too, bf16's safety check reads ``cpu_flags`` (and ``bf16_matmul_works`` where AMX is
advertised), pool sizing reads the memory figures. /proc/cpuinfo is read once per process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys


@functools.cache
def cpu_info() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and feature flags as /proc/cpuinfo lists them (where it does)."""
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
    return name, tuple(flags.split())


def cpu_flags() -> set[str]:
    return set(cpu_info()[1])


def machine_key() -> str:
    """CPU model, its flags, the cores and torch's version: what measured answers (the dtype
    probe, built kernels, KV they computed) depend on."""
    import torch
    import xxhash

    name, flags = cpu_info()
    text = f"{name}|{' '.join(flags)}|{torch.__version__}|{os.cpu_count()}"
    return xxhash.xxh64(text.encode()).hexdigest()


def machine_memory_bytes() -> int:
    """Physical memory (8 GiB where the system will not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def available_memory_bytes() -> int:
    """Memory the process can still take: MemAvailable, or a cgroup limit when lower."""
    available = machine_memory_bytes()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for path, used_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(path) as f, open(used_path) as g:
                limit = f.read().strip()
                if limit.isdigit():
                    available = min(available, int(limit) - int(g.read().strip()))
        except (OSError, ValueError):
            continue
    return available


_BF16_PRODUCT = (
    "import torch; a = torch.randn(64, 576, dtype=torch.bfloat16); "
    "b = torch.randn(1536, 576, dtype=torch.bfloat16); torch.nn.functional.linear(a, b)"
)


@functools.cache
def bf16_matmul_works() -> bool:
    """Run a bf16 matrix product in a child process: some VMs advertise AMX but kill the
    process with SIGILL on the first AMX instruction (seen here: a Firecracker guest)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _BF16_PRODUCT], capture_output=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0
