"""The helper team our kernels split calls over (``csrc/team.h``): a call's bits never depend on
which threads ran its items, whether the helpers were busy, starved of the CPU or absent (a
forked child has none), and a call finishes with only the calling thread running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import ModuleType

import pytest
import torch

from engine.model.cpu.products import PackedWeight, load_products
from engine.model.platform import RMSNORM

SPIN = "while True: pass"


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = load_products()
    assert module is not None, "our products did not build on this machine"
    return module


def model_call(kernel: ModuleType) -> tuple[PackedWeight, torch.Tensor, torch.Tensor]:
    """SmolLM2's fused gate/up product with its RMSNorm prologue: 96 panels, two phases."""
    gen = torch.Generator().manual_seed(7)
    packed = PackedWeight(kernel, torch.randn(3072, 576, generator=gen))
    return packed, torch.randn(5, 576, generator=gen), torch.rand(576, generator=gen) + 0.5


def helper_threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")} - {os.getpid(), _my_tid()}


def _my_tid() -> int:
    return int(os.readlink("/proc/thread-self").rsplit("/", 1)[1])


def test_calls_on_two_threads_beside_busy_processes_keep_their_quiet_bits(
    kernel: ModuleType,
) -> None:
    packed, x, norm = model_call(kernel)
    quiet = packed(x, RMSNORM, norm, 1e-5, threads=2)
    alone = packed(x, RMSNORM, norm, 1e-5, threads=1)
    busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2)]
    try:
        for _ in range(200):
            assert torch.equal(packed(x, RMSNORM, norm, 1e-5, threads=2), quiet)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert torch.equal(alone, quiet)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_calls_alone_with_the_parents_bits(kernel: ModuleType) -> None:
    """The child inherits the team's bookkeeping but none of its threads: its calls must not
    wait for them, and compute what the parent's team computed."""
    packed, x, norm = model_call(kernel)
    want = packed(x, RMSNORM, norm, 1e-5, threads=2)  # the parent's team now has a helper
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running the parent's cleanup
        try:
            got = packed(x, RMSNORM, norm, 1e-5, threads=2)
            os.write(write, b"equal" if torch.equal(got, want) else b"differ")
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            answer = pipe.read()
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert answer == b"equal"


@pytest.mark.skipif(
    not hasattr(os, "sched_setscheduler") or (os.cpu_count() or 1) < 2,
    reason="needs Linux scheduling policies and two CPUs",
)
def test_a_call_finishes_without_its_helper_and_keeps_its_bits(kernel: ModuleType) -> None:
    """The helper made SCHED_IDLE and pinned beside a busy process on one CPU (it then runs
    only in scraps of time): every call must still finish, with the caller doing the work,
    and give the quiet bits. Under an OpenMP barrier each call would wait for that helper."""
    packed, x, norm = model_call(kernel)
    want = packed(x, RMSNORM, norm, 1e-5, threads=2)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs in the process's affinity")
    helpers = helper_threads()
    assert helpers, "a two-thread call made no helper"
    mine = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        os.sched_setaffinity(busy.pid, {cpus[0]})
        for tid in helpers:
            try:
                os.sched_setaffinity(tid, {cpus[0]})
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass  # a thread of torch's that ended meanwhile
        os.sched_setaffinity(0, {cpus[1]})
        for _ in range(300):
            assert torch.equal(packed(x, RMSNORM, norm, 1e-5, threads=2), want)
    finally:
        os.sched_setaffinity(0, mine)
        for tid in helpers:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.sched_setaffinity(tid, mine)
            except OSError:
                pass
        busy.send_signal(signal.SIGKILL)
        busy.wait()
