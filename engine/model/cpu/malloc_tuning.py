"""glibc's malloc, told to keep the memory a pass frees for the next pass.

A forward pass allocates and frees the same activation buffers (megabytes each) every step.
glibc adapts two thresholds to the sizes freed so far: buffers above the *mmap* threshold are
mapped and unmapped per allocation, and freed memory above the *trim* threshold at the top of a
thread's heap is handed back to the kernel (``madvise``). Either way the next pass writes into
fresh pages, and every first write of a 4 KiB page is a fault the kernel serves by zeroing it.
Where the thresholds land depends on what the process freed first, so the same server ran at
two speeds from one start to the next, the slow starts spending a large share of their time in
the kernel's page-fault and ``madvise`` paths (``python -m workloads.serve_bench`` shows the
spread across starts). Fixing both thresholds (which also stops glibc adapting them) keeps the
freed buffers in the heap: every start runs at the fast speed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

DISABLE_ENV = "RADIXKV_MALLOC_TUNING"  # "0" leaves glibc's defaults
# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap: glibc's ceiling for the threshold on 64-bit
# (a 2,048-token prefill's largest activation, its fused gate and up rows, is 25 MB).
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of a heap kept up to this much (a step's buffers are far below it).
TRIM_THRESHOLD = 1 << 30
# The user's own allocator settings win: glibc's environment knobs, or another allocator.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); True if they were set.
    Not on other C libraries, under a preloaded allocator, where the user set glibc's own
    knobs, or with ``RADIXKV_MALLOC_TUNING=0``."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # tcmalloc, jemalloc, mimalloc
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # both are set, whatever the first gives
    trim_set = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return mmap_set == 1 and trim_set == 1  # mallopt returns 1 on success
