"""The thread policy: the whole team for prefill-sized passes, one thread for decode steps."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.model.bringup.platforms import platform_for
from engine.model.cpu.threads import PARALLEL_MIN_TOKENS, ThreadPolicy, release_openmp_team
from engine.model.kv_pool import KVPool
from engine.model.runner import ModelRunner
from scheduler import SamplingParams
from scheduler.batch import Batch
from scheduler.request import Request


def test_big_batches_get_every_thread_and_small_ones_one() -> None:
    policy = ThreadPolicy(4)
    assert policy.threads_for(PARALLEL_MIN_TOKENS) == 4
    assert policy.threads_for(PARALLEL_MIN_TOKENS - 1) == 1
    assert ThreadPolicy(1).threads_for(10_000) == 1


@pytest.mark.parametrize("threads", [0, -2, 1.5])
def test_bad_thread_counts_raise_value_error_naming_threads(threads: Any) -> None:
    with pytest.raises(ValueError, match="threads"):
        ThreadPolicy(threads)


def test_engine_rejects_a_bad_thread_count_before_loading(make_engine: Any) -> None:
    with pytest.raises(ValueError, match="threads"):
        make_engine(num_pages=8, threads=0)


def test_runner_sets_torch_threads_per_pass(loaded_fp32: Any, make_entry: Any) -> None:
    cfg = loaded_fp32.config
    pool = KVPool(cfg.num_layers, 32, 16, cfg.num_kv_heads, cfg.head_dim)
    platform = platform_for(loaded_fp32.device, threads=ThreadPolicy(2))
    runner = ModelRunner(loaded_fp32, pool, platform)
    before = torch.get_num_threads()
    try:
        big = Request(0, list(range(100, 100 + PARALLEL_MIN_TOKENS)), SamplingParams(max_new_tokens=1))
        runner.forward(Batch([make_entry(big, big.prompt, 0, list(range(8)), 16)], 16))
        assert torch.get_num_threads() == 2
        small = Request(1, list(range(100, 120)), SamplingParams(max_new_tokens=1))
        runner.forward(Batch([make_entry(small, small.prompt, 0, [20, 21], 16)], 16))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_default_policy_keeps_the_starting_thread_count_after_a_decode_step_lowered_torchs(
) -> None:
    """A decode step sets torch's threads to one; an engine made after it must not inherit
    that as its "default" (it would then run every product and attention on one core)."""
    from engine.model.cpu import threads as threads_module

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what a decode step leaves behind
        policy = ThreadPolicy.default(None)
        assert policy.max_threads == threads_module.STARTING_THREADS
        assert ThreadPolicy.default(3).max_threads == 3
    finally:
        torch.set_num_threads(before)


def test_a_thread_frees_its_openmp_team_and_its_next_pass_computes_the_same(
    loaded_fp32: Any, make_entry: Any
) -> None:
    """The engine frees the OpenMP team of the thread that built it, and the loop its own when
    idle (``release_openmp_team``): the runtime torch ships must be found and the call must
    succeed, and a pass after it (on a new team) gives the same bits."""
    cfg = loaded_fp32.config
    pool = KVPool(cfg.num_layers, 32, 16, cfg.num_kv_heads, cfg.head_dim)
    platform = platform_for(loaded_fp32.device, threads=ThreadPolicy(2))
    runner = ModelRunner(loaded_fp32, pool, platform, batch_invariant=True)
    request = Request(0, list(range(100, 100 + PARALLEL_MIN_TOKENS)), SamplingParams())
    batch = Batch([make_entry(request, request.prompt, 0, list(range(8)), 16)], 16)
    before = torch.get_num_threads()
    try:
        first = runner.forward(batch)
        assert release_openmp_team()
        assert torch.equal(runner.forward(batch), first)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("cpu_max", "cap"),
    [("50000 100000\n", 1), ("150000 100000\n", 2), ("max 100000\n", None), ("garbage", None)],
)
def test_cores_granted_is_capped_by_a_cgroup_quota(
    tmp_path: Any, cpu_max: str, cap: int | None
) -> None:
    """A quota of 1.5 CPUs grants 2 threads' worth of turns, 0.5 CPU one; none: the CPUs the
    process may run on."""
    from engine.model.cpu.threads import cores_granted

    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    want = affinity if cap is None else min(cap, affinity)
    assert cores_granted(str(path)) == want
    assert cores_granted(str(tmp_path / "missing")) == affinity
