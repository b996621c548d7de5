"""Speculative decoding as a step extension: decode entries become verify entries (the last
token plus draft tokens from the radix tree and n-gram lookups, ``drafter.Drafter``) where the
gate (``gate.SpeculationGate``) expects them to pay; what verification accepted feeds
the gate and the counters."""

from __future__ import annotations

from collections.abc import Sequence

from radix import KVManager
from scheduler.batch import Batch, BatchEntry
from scheduler.counters import SchedulerCounters
from scheduler.request import Request
from scheduler.speculation.drafter import Draft, Drafter
from scheduler.speculation.gate import Candidate, SpeculationGate
from scheduler.step_plan import StepPlan


class SpeculativeDecoding:
    """Drafts up to ``max_tokens`` per request and step; counts into ``counters``."""

    def __init__(self, kv: KVManager, max_tokens: int, counters: SchedulerCounters) -> None:
        self.drafter = Drafter(kv, max_tokens)
        self.gate = SpeculationGate()
        self.max_tokens = max_tokens
        self.accepted_per_pos = [0] * max_tokens
        self._counters = counters
        self._prefix_cache = kv.prefix_cache
        self._verifying: dict[Request, Draft] = {}  # the draft each request verifies

    def extend(self, plan: StepPlan, kv: KVManager) -> None:
        """Turn decode entries into verify entries where the gate grants draft tokens; pages
        for them come from the free list only, and they fit the step's token budget."""
        tokens, sampled = plan.num_tokens, plan.num_sampled
        if plan.budget <= 0 or not self.gate.may_grant(tokens, sampled):
            return
        wants = [(request, min(self.max_tokens, request.max_new_tokens - len(request.output) - 1))
                 for request, entry in plan.entries.items() if entry.is_decode]
        candidates = [Candidate(request, draft)
                      for (request, _), draft in zip(wants, self.drafter.propose_all(wants))
                      if draft.tokens]
        if not candidates:
            return
        granted = self.gate.grant(candidates, tokens, sampled, plan.budget)
        for candidate, k in zip(candidates, granted):
            request = candidate.request
            entry = plan.entries[request]
            handle = request.kv
            if k == 0 or handle is None or not kv.allocate(handle, entry.kv_len + k, evict=False):
                continue
            draft = candidate.draft.tokens[:k]
            plan.place(request, entry.input_ids + draft, entry.start_pos, handle.pages, True,
                       draft)
            plan.budget -= k
            self._verifying[request] = candidate.draft

    def committed(self, entry: BatchEntry, accepted: Sequence[int]) -> None:
        """Count the verification of ``entry``'s draft (a follower's draft is its leader's
        tokens, counted there) and tell the gate how much of what it granted was accepted."""
        draft = self._verifying.pop(entry.request, None)
        if entry.leader is not None:
            return
        matched = 0
        while matched < min(len(entry.draft), len(accepted)) and (
            accepted[matched] == entry.draft[matched]
        ):
            matched += 1
        counters = self._counters
        counters.spec_decode_num_drafts += 1
        counters.spec_decode_num_draft_tokens += len(entry.draft)
        counters.spec_decode_num_accepted_tokens += matched
        for position in range(matched):
            self.accepted_per_pos[position] += 1
        if draft is not None:
            self.gate.record(entry.request, draft, len(entry.draft), matched)

    def forget(self, request: Request, finished: bool) -> None:
        """A finished request's tokens stay draftable (with the prefix cache on); an aborted
        one's do not."""
        if finished and self._prefix_cache:
            self.drafter.finished(request)
        else:
            self.drafter.forget(request)
        self.gate.forget(request)
        self._verifying.pop(request, None)

    def observe_step(self, batch: Batch, seconds: float) -> None:
        """Only passes of decodes and verifies are fitted: a prompt token computes no logits
        and rides in a taller matrix product, so passes with prefill in them make a draft row
        look cheaper than it is (``workloads.spec_bench`` measures the difference)."""
        if all(e.is_decode for e in batch.entries):
            self.gate.cost.observe(batch.num_computed_rows, seconds)
