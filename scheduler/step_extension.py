"""What a step feature needs of the scheduler: a small seam, so features do not live in it.

A ``StepExtension`` sees each step's plan after the scheduler made it (decodes, prefill
chunks, admissions) and may rewrite entries (``extend``); it learns what a step committed for
the entries it shaped (``committed``) and when a request leaves (``forget``). Speculative
decoding (``speculation.extension.SpeculativeDecoding``) and shared rows
(``shared_rows.SharedRows``) are the two; the scheduler runs them in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radix import KVManager
from scheduler.batch import BatchEntry
from scheduler.request import Request
from scheduler.step_plan import StepPlan


class StepExtension(Protocol):
    def extend(self, plan: StepPlan, kv: KVManager) -> None:
        """Rewrite entries of ``plan`` (pages from ``kv``'s free list only: never by evicting
        or preempting), charging its budget."""

    def committed(self, entry: BatchEntry, accepted: Sequence[int]) -> None:
        """``entry`` (one with a draft) was committed: ``accepted`` its tokens taken."""

    def forget(self, request: Request, finished: bool) -> None:
        """``request`` left (finished: it completed normally; else aborted)."""
