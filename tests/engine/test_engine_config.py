"""EngineConfig: every knob in one checked record; the three commands share its flags."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from cluster.cli import add_serve
from engine import EngineConfig, build_parser

FLAGS = [
    "--model", "m.gguf", "--device", "cpu", "--dtype", "float32", "--page-size", "8",
    "--num-pages", "64", "--max-running", "4", "--max-batch-tokens", "256", "--policy", "fcfs",
    "--no-prefix-cache", "--backend", "torch", "--threads", "2", "--no-batch-invariant",
    "--scheduling-policy", "priority", "--priority-aging-seconds", "0.5",
]
EXPECTED = EngineConfig.make(
    model="m.gguf", device="cpu", dtype="float32", page_size=8, num_pages=64, max_running=4,
    max_batch_tokens=256, policy="fcfs", prefix_cache=False, backend="torch", threads=2,
    batch_invariant=False, scheduling_policy="priority", priority_aging_seconds=0.5,
)


@pytest.mark.parametrize(
    "command", [["chat"], ["generate", "hi"], ["serve"], ["serve", "--replicas", "2"]]
)
def test_every_command_builds_the_same_config_from_the_same_flags(command: list[str]) -> None:
    args = build_parser(add_serve).parse_args([*command, *FLAGS])
    assert EngineConfig.from_args(args) == EXPECTED


def test_flags_not_given_leave_the_defaults() -> None:
    args = build_parser(add_serve).parse_args(["serve"])
    assert EngineConfig.from_args(args) == EngineConfig()
    assert EngineConfig.from_args(args, threads=1).threads == 1  # a command's own default


def test_scheduler_knobs_are_reached_by_their_plain_names() -> None:
    config = EngineConfig.make(page_size=32, group_min_tokens=64)
    assert config.page_size == config.scheduler.page_size == 32
    assert config.scheduler.group_min_tokens == 64
    assert config.replace(page_size=8).scheduler == EngineConfig.make(
        page_size=8, group_min_tokens=64
    ).scheduler
    assert EngineConfig.make(**config.knobs()) == config


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"page_size": 0}, r"page_size: must be an int >= 1, got 0"),
        ({"num_pages": 8, "kv_cache_bytes": 1 << 20}, r"num_pages, kv_cache_bytes"),
        ({"threads": 0}, r"threads: must be an int >= 1, got 0"),
        ({"dtype": "float64"}, r"dtype: unsupported 'float64'"),
        ({"backend": "magic"}, r"backend: unknown 'magic'"),
        ({"kv_host_bytes": 1 << 20, "prefix_cache": False}, r"KV tiers need prefix_cache"),
        ({"kv_disk_bytes": 1 << 20}, r"kv_disk_bytes: needs kv_disk_dir"),
        ({"reserve_ratio": 0.5}, r"reserve_ratio: not an Engine or SchedulerConfig option"),
        ({"group_min_tokens": True}, r"group_min_tokens: must be an int >= 0, got True"),
    ],
)
def test_bad_knobs_are_value_errors_naming_the_knob(knobs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.make(**knobs)


def test_a_bad_flag_value_names_the_knob_not_a_traceback() -> None:
    args = build_parser(add_serve).parse_args(["serve", "--page-size", "0"])
    with pytest.raises(ValueError, match=r"page_size: must be an int >= 1"):
        EngineConfig.from_args(args)


def test_the_step_counted_aging_flag_is_refused_naming_its_replacement() -> None:
    args = build_parser(add_serve).parse_args(["serve", "--priority-aging-steps", "256"])
    with pytest.raises(ValueError, match=r"^priority_aging_steps: .*--priority-aging-seconds"):
        EngineConfig.from_args(args)


def test_torch_dtypes_and_paths_are_kept_as_plain_data(tmp_path) -> None:
    import torch

    config = EngineConfig.make(dtype=torch.bfloat16, kv_disk_dir=tmp_path)
    assert config.dtype == "bfloat16" and config.kv_disk_dir == str(tmp_path)


def test_the_config_loads_without_torch_or_the_model() -> None:
    code = (
        "import sys; from engine import EngineConfig; import cluster.config; "
        "EngineConfig.make(page_size=8); "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_add_arguments_gives_every_knob_a_flag() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    dests = {action.dest for action in parser._actions}
    missing = set(EngineConfig.make().knobs()) - dests
    # Tuning knobs of the scheduler stay Python-only (SchedulerConfig documents them).
    assert missing == {
        "group_min_tokens", "reserve_ratio_init", "reserve_ratio_min", "reserve_margin",
        "reserve_decay", "max_lookahead",
    }
