"""Requests whose next rows are the same rows: computed once, copied to the others.

Two decoding requests of one namespace with the same prompt and the same output so far, whose
sampling is a function of those tokens alone (greedy, or seeded with the same seed: the noise is
keyed by the token's index in the output) and the same sampling knobs, get the same logits from
a batch-invariant pass and so the same next tokens, and write the same K/V. That happens
whenever identical requests are in flight together: ``n`` greedy choices, a client's retry
while the first attempt still runs, one FAQ question from many users. All but one of their
rows are wasted. As a step extension (``SharedRows``), each step the request furthest ahead of
such a group leads, and each other whose tokens so far are a prefix of the leader's (it
started later, or waited for the leader's prefill to hit its prefix) follows it: the
follower's entry feeds the leader's tokens from its own position to the end of the leader's
entry this step (``BatchEntry.leader``), and the runner copies the leader's K/V for those
positions into the follower's slots and gives it the leader's tokens, so it catches up in one
step and keeps step after. How each request finishes (``max_new_tokens``, stops) stays its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import msgspec

from radix import KVManager
from scheduler.batch import BatchEntry
from scheduler.counters import SchedulerCounters
from scheduler.params import SamplingParams
from scheduler.request import Request
from scheduler.step_plan import StepPlan


def sampling_key(params: SamplingParams) -> SamplingParams | None:
    """What decides a request's next token besides its tokens (its finishing knobs and its
    prompt's scores, done before it decodes, cleared), or None where its rows cannot stand
    for another's: unseeded sampling, log-probabilities (per-request results), structured
    outputs (a matcher per request), ``min_tokens`` (its stop tokens are masked by count)."""
    if (not params.is_greedy and params.seed is None) or params.logprobs is not None:
        return None
    if params.structured_outputs is not None or params.min_tokens:
        return None
    return msgspec.structs.replace(
        params, max_new_tokens=1, stop=[], stop_token_ids=[], prompt_logprobs=None,
        include_stop_str_in_output=False, skip_special_tokens=True,
    )


def sharing_key(request: Request) -> tuple[object, ...] | None:
    """What requests that can stand for each other share, as a dict key: namespace and prompt
    (hashed; prompts and sampling are compared by ``follows``); None where the request can
    share no rows. Made once per request (its prompt and params never change)."""
    if sampling_key(request.params) is None:
        return None
    return (request.namespace, hash(tuple(request.prompt)))


def follows(behind: Request, ahead: Request) -> bool:
    """For two requests of one ``sharing_key``: whether ``behind``'s tokens so far are a prefix
    of ``ahead``'s and their sampling is the same, so that ``ahead``'s rows (K/V and tokens,
    computed already or in this step) are ``behind``'s."""
    n, m = len(behind.output), len(ahead.output)
    if n > m or behind.prompt != ahead.prompt:
        return False
    # In step (the usual case) the outputs compare whole; only a request behind slices.
    if behind.output != (ahead.output if n == m else ahead.output[:n]):
        return False
    a, b = behind.params, ahead.params  # n choices share one params object: no key made
    return a is b or a == b or sampling_key(a) == sampling_key(b)


class SharedRows:
    """Makes followers of leaders each step; counts the rows they received into
    ``counters``."""

    def __init__(self, counters: SchedulerCounters) -> None:
        self._counters = counters
        self._keys: dict[Request, tuple[object, ...] | None] = {}  # made once per request

    def extend(self, plan: StepPlan, kv: KVManager) -> None:
        """Make each decoding request that follows another of this step a follower of the
        one furthest ahead: it feeds that one's tokens up to the end of its entry."""
        groups: dict[tuple[object, ...], list[BatchEntry]] = {}
        keys = self._keys
        for request, entry in plan.entries.items():
            if not entry.is_decode:
                continue
            if request not in keys:
                keys[request] = sharing_key(request)
            key = keys[request]
            if key is not None:
                groups.setdefault(key, []).append(entry)
        followers: list[tuple[Request, BatchEntry]] = []
        for group in groups.values():
            if len(group) < 2:
                continue
            group.sort(key=lambda e: -len(e.request.output))
            leaders: list[BatchEntry] = []
            for entry in group:
                leader = next((e for e in leaders if follows(entry.request, e.request)), None)
                follower = None if leader is None else self._follower(entry, leader, plan, kv)
                if follower is None:
                    leaders.append(entry)
                else:
                    followers.append(follower)
        for request, follower in followers:
            plan.entries[request] = follower
            self._counters.shared_rows += len(follower.input_ids)

    def _follower(
        self, entry: BatchEntry, leader: BatchEntry, plan: StepPlan, kv: KVManager
    ) -> tuple[Request, BatchEntry] | None:
        """``entry`` as ``leader``'s follower: it feeds ``leader``'s tokens from its own
        position to the end of ``leader``'s entry (draft included). None where those are more
        tokens than the step's budget has left or its pages can cover without evicting. Not
        yet in the plan: the step's entries are still being read."""
        request = entry.request
        start = entry.start_pos
        if start == leader.start_pos and entry.input_ids == leader.input_ids:
            return request, replace(entry, leader=leader)
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
        follower = plan.make_entry(
            request, inputs, start, handle.pages, True, inputs[1:], leader=leader
        )
        return request, follower

    def committed(self, entry: BatchEntry, accepted: Sequence[int]) -> None:
        return None

    def forget(self, request: Request, finished: bool) -> None:
        self._keys.pop(request, None)
