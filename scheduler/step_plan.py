"""One step's plan while the scheduler makes it: the entries so far, the token budget left,
and the one place a request's positions become pages and slots (``StepPlan.place``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.batch import Batch, BatchEntry, pages_for, slots_for
from scheduler.request import Request


@dataclass
class StepPlan:
    """Entries by request (insertion order is the batch's order) within ``budget`` tokens.

    The scheduler fills it (decodes, prefill chunks, admissions); step extensions
    (speculation, shared rows) then rewrite entries through ``place``."""

    budget: int
    page_size: int
    entries: dict[Request, BatchEntry] = field(default_factory=dict)

    def make_entry(
        self,
        request: Request,
        input_ids: list[int],
        start: int,
        table: Sequence[int],
        sample: bool,
        draft: list[int] | None = None,
        scored: range = range(0),
        leader: BatchEntry | None = None,
    ) -> BatchEntry:
        """The entry feeding ``input_ids`` at ``start`` over page table ``table`` (a request's
        pages, perhaps more than this step needs)."""
        end = start + len(input_ids)
        pages = list(table[: pages_for(end, self.page_size)])
        return BatchEntry(
            request, input_ids, start, pages, slots_for(pages, self.page_size, start, end),
            sample, draft if draft is not None else [], leader, scored,
        )

    def place(
        self,
        request: Request,
        input_ids: list[int],
        start: int,
        table: Sequence[int],
        sample: bool,
        draft: list[int] | None = None,
        scored: range = range(0),
    ) -> BatchEntry:
        """``make_entry``, set as ``request``'s entry in the plan. The budget is the caller's
        to charge."""
        entry = self.make_entry(request, input_ids, start, table, sample, draft, scored)
        self.entries[request] = entry
        return entry

    def drop(self, request: Request) -> None:
        """Take ``request``'s entry out (it was preempted), its tokens back to the budget."""
        entry = self.entries.pop(request, None)
        if entry is not None:
            self.budget += len(entry.input_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.entries.values())

    @property
    def num_sampled(self) -> int:
        return sum(1 for e in self.entries.values() if e.sample)

    def batch(self) -> Batch:
        return Batch(entries=list(self.entries.values()), page_size=self.page_size)
