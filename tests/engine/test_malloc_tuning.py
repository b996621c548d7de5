"""glibc keeps the memory a pass frees (``engine.model.cpu.malloc_tuning``)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from engine.model.cpu import malloc_tuning

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
# Elsewhere the tuning is never applied, so there is nothing for these tests to tell apart.
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")

# Run in a fresh interpreter: glibc's thresholds are process state, and adapt to what the
# process freed before.
PROBE = textwrap.dedent(
    """
    import ctypes
    from engine.model.cpu.malloc_tuning import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.mallinfo2.restype = MallInfo2
    print(keep_freed_memory())
    mapped = -libc.mallinfo2().hblks
    big = libc.malloc(4 << 20)  # an activation buffer of a few MB
    mapped += libc.mallinfo2().hblks
    libc.free(big)
    buffers = [libc.malloc(1 << 20) for _ in range(64)]  # a pass's buffers, then freed
    for b in buffers:
        libc.free(b)
    print(mapped, libc.mallinfo2().arena >> 20)
    """
)


@needs_glibc
@pytest.mark.skipif(GLIBC and not hasattr(ctypes.CDLL(None), "mallinfo2"),
                    reason="mallinfo2 needs glibc 2.33")
def test_freed_pass_buffers_stay_in_the_heap_for_the_next_pass() -> None:
    env = {k: v for k, v in os.environ.items() if k not in malloc_tuning.USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, check=True, cwd=os.getcwd()).stdout.split()
    applied, big_mapped_alone, heap_mb_after_free = out[0], int(out[1]), int(out[2])
    assert applied == "True"
    # glibc's default maps a 4 MB block on its own (unmapped when freed); tuned, it comes
    # from the heap, and 64 MB freed at the heap's top stays there instead of being trimmed.
    assert big_mapped_alone == 0
    assert heap_mb_after_free >= 64


@needs_glibc
@pytest.mark.parametrize("name", malloc_tuning.USER_SETTINGS)
def test_the_users_own_malloc_settings_are_left_alone(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv(name, "1")
    assert malloc_tuning.keep_freed_memory.__wrapped__() is False


@needs_glibc
def test_the_tuning_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(malloc_tuning.DISABLE_ENV, "0")
    assert malloc_tuning.keep_freed_memory.__wrapped__() is False
