"""Every native entry point (exact_attention, rope_write_attend, dense, pack), given a bad
argument (a wrong shape, dtype, stride or device; a page id, slot, position or table length out
of range; a plan that is not one; a bad group or thread count), raises a RuntimeError, and an
empty batch is an empty result: never a crash, at 1, 2 and 16 threads (oversubscribed here).

The calls run in a worker process (``native_fuzz_worker.py``), fed cases over a pipe, so a crash
fails the case that caused it instead of killing the suite; a dead worker is started again.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.native_fuzz_worker import MUTATIONS

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("native_fuzz_worker.py")
CASE_TIMEOUT_S = 120.0  # a hang is a failure too (the first case may wait for a build)
THREADS = [1, 2, 16]
EXAMPLES = 100  # per entry point


class Worker:
    """One long-lived child that runs cases; restarted after it dies."""

    def __init__(self, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.stderr = open(self.stderr_path, "w")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr, text=True, env=env, cwd=ROOT,
        )
        ready = self._read()
        if ready is None or not ready.get("ready"):
            raise AssertionError(f"the fuzz worker did not start: {ready} {self._stderr_tail()}")

    def _read(self) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], CASE_TIMEOUT_S)
        if not readable:
            self.proc.kill()
            self.proc.wait()
            return {"outcome": "hang"}
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def _stderr_tail(self) -> str:
        self.stderr.flush()
        return " | ".join(self.stderr_path.read_text().strip().splitlines()[-4:])

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        """The case's outcome; ``{"outcome": "crash", ...}`` where the worker died on it."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            result = self._read()
        except BrokenPipeError:
            result = None
        if result is None or result.get("outcome") == "hang":
            code = self.proc.wait()
            outcome = "hang" if result else "crash"
            return {"outcome": outcome, "returncode": code, "stderr": self._stderr_tail()}
        return result

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(tmp_path_factory.mktemp("fuzz") / "worker.stderr")
    yield w
    w.close()


def check(worker: Worker, entry: str, mutation: str, seed: int, threads: int) -> None:
    case = {"entry": entry, "mutation": mutation, "seed": seed, "threads": threads}
    got = worker.run(case)
    assert got["outcome"] in ("ok", "error"), f"{case}: {got}"
    if mutation in ("valid", "empty"):
        assert got["outcome"] == "ok", f"{case}: a good call was refused: {got}"
        if mutation == "empty":
            assert got["shape"][0] == 0, f"{case}: {got}"
    else:
        assert got["outcome"] == "error", f"{case}: a bad argument was accepted"
        assert got["runtime_error"] and got["message"], f"{case}: not a clear RuntimeError: {got}"


def _cases(entry: str) -> Any:
    return given(
        mutation=st.sampled_from(MUTATIONS[entry]),
        seed=st.integers(0, 2**32 - 1),
        threads=st.sampled_from(THREADS),
    )


FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@_cases("exact_attention")
def test_attention_refuses_every_bad_argument_without_crashing(
    worker: Worker, mutation: str, seed: int, threads: int
) -> None:
    check(worker, "exact_attention", mutation, seed, threads)


@FUZZ
@_cases("rope_write_attend")
def test_fused_attention_refuses_every_bad_argument_without_crashing(
    worker: Worker, mutation: str, seed: int, threads: int
) -> None:
    check(worker, "rope_write_attend", mutation, seed, threads)


@FUZZ
@_cases("dense")
def test_products_refuse_every_bad_argument_without_crashing(
    worker: Worker, mutation: str, seed: int, threads: int
) -> None:
    check(worker, "dense", mutation, seed, threads)


@FUZZ
@_cases("pack")
def test_packing_refuses_every_bad_weight_without_crashing(
    worker: Worker, mutation: str, seed: int, threads: int
) -> None:
    check(worker, "pack", mutation, seed, threads)


@pytest.mark.parametrize("entry", sorted(MUTATIONS))
def test_every_mutation_of_every_entry_point_is_tried_at_every_thread_count(
    worker: Worker, entry: str
) -> None:
    """Hypothesis samples; this walks the whole table once (seed 0), so no kind of bad
    argument goes untried whatever the draw."""
    for i, mutation in enumerate(MUTATIONS[entry]):
        check(worker, entry, mutation, 0, THREADS[i % len(THREADS)])
