"""Each replica's own disk tier under the cluster's ``--kv-disk-dir``.

A disk store belongs to one engine (it locks its directory), so replicas cannot share one.
Each replica claims a slot, ``<dir>/replica-<i>``, by an exclusive lock on
``<dir>/replica-<i>.claim`` held for its whole life: the first free slot is its own. The lock
goes with the process, so a replica that replaces a dead one (or a restarted cluster) takes
a free slot back with its pages, and announces them (a store's listener first hears what it
holds), so the router finds them again. The disk budget is shared: each replica gets its
share of ``kv_disk_bytes``, or of the engine's default (half the free space, at most 16 GiB),
so N replicas never claim N times the disk.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from engine import EngineConfig


class DiskSlot:
    """A claimed slot: ``folder`` is this replica's store; the claim lasts until ``release``
    or the process ends."""

    def __init__(self, folder: Path, fd: int) -> None:
        self.folder = folder
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim(root: Path, replicas: int) -> DiskSlot:
    """The first slot under ``root`` no live process holds; RuntimeError if every one of
    ``4 * replicas + 8`` is held (more replicas than a cluster of ``replicas`` can have)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for i in range(4 * replicas + 8):
        fd = os.open(root / f"replica-{i}.claim", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return DiskSlot(root / f"replica-{i}", fd)
    raise RuntimeError(f"kv_disk_dir: every replica slot under {root} is held by a live process")


def share(root: Path, replicas: int, kv_disk_bytes: int | None) -> int:
    """One replica's disk budget: its share of ``kv_disk_bytes``, or of the engine's default
    for ``root``'s free space."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    budget = EngineConfig(kv_disk_dir=str(root), kv_disk_bytes=kv_disk_bytes).disk_budget(root)
    return max(budget // replicas, 1)
