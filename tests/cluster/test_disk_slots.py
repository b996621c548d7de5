"""Replicas' disk tiers under one --kv-disk-dir: each claims a slot no live process holds, a
slot given back (or whose process died) is taken again with its folder, and the budget is
shared, never multiplied."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import disk_slots


def test_replicas_claim_different_slots_and_a_released_one_is_taken_again(tmp_path: Path) -> None:
    first = disk_slots.claim(tmp_path, 2)
    second = disk_slots.claim(tmp_path, 2)
    assert first.folder != second.folder
    assert {first.folder.name, second.folder.name} == {"replica-0", "replica-1"}
    first.release()
    again = disk_slots.claim(tmp_path, 2)
    assert again.folder == first.folder  # a replacement finds the pages left there
    for claim in (second, again):
        claim.release()
    for file in tmp_path.iterdir():
        assert stat.S_IMODE(os.stat(file).st_mode) & 0o077 == 0, file.name


def test_a_slot_held_by_another_process_is_skipped_until_it_ends(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from cluster import disk_slots; "
         "s = disk_slots.claim(Path(sys.argv[1]), 2); print(s.folder.name, flush=True); "
         "time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None
        held = holder.stdout.readline().strip()
        mine = disk_slots.claim(tmp_path, 2)
        assert mine.folder.name != held
        mine.release()
    finally:
        holder.kill()
        holder.wait()
    # the process is gone, and its lock with it
    assert disk_slots.claim(tmp_path, 2).folder.name == "replica-0"


def test_every_slot_held_is_an_error_not_a_shared_store(tmp_path: Path) -> None:
    held = [disk_slots.claim(tmp_path, 1) for _ in range(12)]
    with pytest.raises(RuntimeError, match="kv_disk_dir"):
        disk_slots.claim(tmp_path, 1)
    for slot in held:
        slot.release()


def test_the_disk_budget_is_shared_among_the_replicas(tmp_path: Path) -> None:
    assert disk_slots.share(tmp_path, 4, 8 << 30) == 2 << 30
    default = disk_slots.share(tmp_path, 1, None)  # the free space moves a little meanwhile
    assert abs(disk_slots.share(tmp_path, 2, None) - default // 2) < 64 << 20
    assert default <= 16 << 30  # the engine's cap (EngineConfig.disk_budget)
