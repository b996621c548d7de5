"""Busy processes beside a benchmark, running only while a timed run is (``--beside N``).

A server shares its machine with an API front, a tokenizer, a neighbour's job. The neighbours
are plain spinning processes, started once and held stopped (SIGSTOP) between timed runs, so
one bench run measures every case quiet and beside them, interleaved: the ratio of the two is
the figure (the fair share of C cores among T runnable threads is C / T per thread).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

SPIN = "while True: pass"
# A process woken by SIGCONT is placed ahead of the ones that kept running (the scheduler's
# credit for sleepers), so for its first few milliseconds it takes the core from them: a timed
# run starts once that credit is spent, as it is on a machine whose neighbours never stop.
SETTLE_S = 0.25


class Neighbours:
    """``count`` spinning processes, stopped until ``running()``; killed by ``close()``."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"beside: at least 1 busy process, got {count}")
        self.count = count
        self._procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        for proc in self._procs:
            os.kill(proc.pid, sig)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._signal(signal.SIGCONT)
        time.sleep(SETTLE_S)
        try:
            yield
        finally:
            self._signal(signal.SIGSTOP)

    def beside(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` run while the neighbours spin (its own ``elapsed``, if it sets one, kept)."""

        def run() -> None:
            with self.running():
                fn()
            elapsed = getattr(fn, "elapsed", None)
            if elapsed is not None:
                run.elapsed = elapsed  # type: ignore[attr-defined]

        return run

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()

    def __enter__(self) -> Neighbours:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
