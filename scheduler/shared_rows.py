"""Identical requests in flight computed once, as a step extension: a decoding request that
follows another of the step (``twins.follows``: its tokens a prefix of the other's, the same
sampling) becomes that one's twin and is given its rows (``BatchEntry.twin_of``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from radix import KVManager
from scheduler.batch import BatchEntry
from scheduler.counters import SchedulerCounters
from scheduler.request import Request
from scheduler.step_plan import StepPlan
from scheduler.twins import follows, twin_key


class SharedRows:
    """Pairs twins each step; counts the rows they received into ``counters``."""

    def __init__(self, counters: SchedulerCounters) -> None:
        self._counters = counters
        self._keys: dict[Request, tuple[object, ...] | None] = {}  # made once per request

    def extend(self, plan: StepPlan, kv: KVManager) -> None:
        """Make each decoding request that follows another of this step a twin of the one
        furthest ahead: it feeds that one's tokens up to the end of its entry."""
        groups: dict[tuple[object, ...], list[BatchEntry]] = {}
        keys = self._keys
        for request, entry in plan.entries.items():
            if not entry.is_decode:
                continue
            if request not in keys:
                keys[request] = twin_key(request)
            key = keys[request]
            if key is not None:
                groups.setdefault(key, []).append(entry)
        twins: list[tuple[Request, BatchEntry]] = []
        for group in groups.values():
            if len(group) < 2:
                continue
            group.sort(key=lambda e: -len(e.request.output))
            leaders: list[BatchEntry] = []
            for entry in group:
                leader = next((e for e in leaders if follows(entry.request, e.request)), None)
                twin = None if leader is None else self._twin(entry, leader, plan, kv)
                if twin is None:
                    leaders.append(entry)
                else:
                    twins.append(twin)
        for request, twin in twins:
            plan.entries[request] = twin
            self._counters.shared_rows += len(twin.input_ids)

    def _twin(
        self, entry: BatchEntry, leader: BatchEntry, plan: StepPlan, kv: KVManager
    ) -> tuple[Request, BatchEntry] | None:
        """``entry`` as ``leader``'s twin: it feeds ``leader``'s tokens from its own position
        to the end of ``leader``'s entry (draft included). None where those are more tokens
        than the step's budget has left or its pages can cover without evicting. Not yet in
        the plan: the step's entries are still being read."""
        request = entry.request
        start = entry.start_pos
        if start == leader.start_pos and entry.input_ids == leader.input_ids:
            return request, replace(entry, twin_of=leader)
        # Decoding, so ``start`` is past the prompt: the tokens come from the leader's output.
        ahead = leader.request
        base = len(ahead.prompt)
        inputs = (ahead.output + leader.draft)[start - base : leader.kv_len - base]
        extra = len(inputs) - len(entry.input_ids)
        handle = request.kv
        if handle is None or extra > plan.budget:
            return None
        if not kv.allocate(handle, leader.kv_len, evict=False):
            return None
        plan.budget -= max(0, extra)
        twin = plan.make_entry(
            request, inputs, start, handle.pages, True, inputs[1:], twin_of=leader
        )
        return request, twin

    def committed(self, entry: BatchEntry, accepted: Sequence[int]) -> None:
        return None

    def forget(self, request: Request, finished: bool) -> None:
        self._keys.pop(request, None)
