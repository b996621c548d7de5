"""The scheduler: which requests run next, how many of their tokens, and on which pages.

One step = ``schedule()`` (plan a batch: decodes, prefill chunks of running requests, then
admissions in policy order, all within ``max_batch_tokens`` and ``max_running``; then the step
extensions: speculative decoding and shared rows, ``step_extension``) followed by
``commit()`` (append sampled tokens, insert computed prefixes into the tree, finish requests).
The scheduler keeps admission, batching, preemption and commit; positions become pages and
slots in ``StepPlan`` alone.

Where KV lives is the ``KVManager``'s business: a running request holds one ``CacheHandle``
(its page table: the tree's pages of its cached prefix, then its private pages), and the
scheduler only asks the manager to acquire, grow, cache and release it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Container, Hashable, Sequence
from dataclasses import replace

from radix import KVManager
from scheduler.batch import Batch, BatchEntry, pages_for
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.grouping import PrefillClaims
from scheduler.matching import MatchIndex, matchable_length, root_anchor
from scheduler.params import SamplingParams
from scheduler.policy import make_queue
from scheduler.priority import PriorityLevels
from scheduler.request import Request, RequestState
from scheduler.resume_queue import ResumeQueue
from scheduler.shared_rows import SharedRows
from scheduler.speculation.extension import SpeculativeDecoding
from scheduler.step_extension import StepExtension
from scheduler.step_plan import StepPlan

# Weight of one finished request in the moving average of the generated fraction.
_RATIO_EMA_WEIGHT = 0.1


class Scheduler:
    """Continuous batching with chunked prefill, prefix-aware admission and preemption.

    ``kv`` must not be shared with another scheduler: each request's handle comes from it.
    """

    def __init__(self, kv: KVManager, config: SchedulerConfig | None = None) -> None:
        if config is None:
            config = SchedulerConfig(page_size=kv.page_size, prefix_cache=kv.prefix_cache)
        if config.page_size != kv.page_size:
            raise ValueError(f"page_size: config has {config.page_size}, the KV {kv.page_size}")
        if config.prefix_cache != kv.prefix_cache:
            raise ValueError(
                f"prefix_cache: config has {config.prefix_cache}, the KV {kv.prefix_cache}"
            )
        self._kv = kv
        self._config = config
        self._page_size = config.page_size
        self._queue = PriorityLevels(
            lambda: make_queue(config.policy, config.page_size), config.priority_aging_seconds
        )
        self._matches = MatchIndex(kv)
        self._resume = ResumeQueue()  # preempted requests, oldest arrival first
        self._running: dict[Request, None] = {}  # admission order: the last is the newest
        self._live: dict[int | str, Request] = {}  # waiting or running, by id
        self._arrivals = itertools.count()
        self._counters = SchedulerCounters()
        self._generated_fraction = config.reserve_ratio_init
        self._preemption_boost = 0.0
        self._inflight: Batch | None = None
        # Step features, in the order they see a plan (None / absent: off).
        self._speculation: SpeculativeDecoding | None = None
        if config.speculation == "tree":
            self._speculation = SpeculativeDecoding(
                kv, config.num_speculative_tokens, self._counters
            )
        self._extensions: list[StepExtension] = []
        if self._speculation is not None:
            self._extensions.append(self._speculation)
        if config.share_rows:
            self._extensions.append(SharedRows(self._counters))

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def kv(self) -> KVManager:
        return self._kv

    @property
    def counters(self) -> SchedulerCounters:
        """A snapshot of the monotone counters (evicted pages as the KV manager counts them)."""
        spec = self._speculation
        per_pos = tuple(spec.accepted_per_pos) if spec is not None else ()
        return replace(
            self._counters,
            evicted_pages=self._kv.evicted_pages,
            spec_decode_num_accepted_tokens_per_pos=per_pos,
        )

    @property
    def has_work(self) -> bool:
        return bool(self._running) or bool(self._resume) or len(self._queue) > 0

    @property
    def num_waiting(self) -> int:
        return len(self._queue) + len(self._resume)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def reserve_ratio(self) -> float:
        """Fraction of the remaining max_new_tokens admission reserves pages for."""
        cfg = self._config
        ratio = min(1.0, self._generated_fraction + cfg.reserve_margin)
        return max(cfg.reserve_ratio_min, ratio, self._preemption_boost)

    def add(self, request: Request) -> None:
        """Queue a new request (state WAITING)."""
        if request.state is not RequestState.WAITING or request.admitted:
            raise ValueError(f"request: must be a new WAITING request, got {request.state.value}")
        if request.id in self._live:
            raise ValueError(f"request.id: {request.id!r} is already queued or running")
        if not isinstance(request.params, SamplingParams):
            raise ValueError(
                f"request.params: expected SamplingParams, got {type(request.params).__name__}"
            )
        if request.params.priority and self._config.scheduling_policy != "priority":
            raise ValueError(
                f"priority: {request.params.priority} needs priority scheduling "
                '(scheduling_policy="priority"; the server\'s --scheduling-policy priority); '
                "this engine schedules first come, first served (priority 0 only)"
            )
        if not isinstance(request.prompt, list):
            request.prompt = list(request.prompt)
        if not request.prompt:
            raise ValueError("request.prompt: must hold at least 1 token, got 0")
        pages = pages_for(len(request.prompt) + request.max_new_tokens - 1, self._page_size)
        if pages > self._kv.num_pages:
            raise ValueError(
                f"request.prompt: {len(request.prompt)} tokens + max_new_tokens "
                f"{request.max_new_tokens} need {pages} KV pages, the pool has "
                f"{self._kv.num_pages}"
            )
        request.arrival = next(self._arrivals)
        request.output = list(request.output)
        self._live[request.id] = request
        self._counters.requests += 1
        self._push_waiting(request)

    def abort(self, request_id: int | str) -> Request | None:
        """Drop a request in any state, freeing everything it holds (None if unknown/done)."""
        request = self._live.get(request_id)
        if request is None:
            return None
        if request.state is RequestState.RUNNING:
            self._release(request, keep=False)
        else:
            self._drop_waiting(request)
        self._retire(request, RequestState.ABORTED, "abort")
        self._counters.aborted += 1
        return request

    def schedule(self) -> Batch | None:
        """Plan the next forward pass; None when there is nothing to run."""
        if self._inflight is not None:
            raise RuntimeError(
                "schedule: the previous batch was neither committed nor discarded"
            )
        if not self.has_work:
            return None
        cfg = self._config
        self._preemption_boost = max(0.0, self._preemption_boost - cfg.reserve_decay)
        for request in self._matches.refresh():
            self._queue.update(request, self._matches.get(request).length)

        plan = StepPlan(budget=cfg.max_batch_tokens, page_size=self._page_size)
        # 1. One token for every decoding request (preempting the newest when pages run out).
        for request in list(self._running):
            if request.state is RequestState.RUNNING and not request.is_prefilling:
                self._plan_tokens(plan, request, 1)
        # 2. The next chunk of every request still prefilling, oldest first.
        for request in list(self._running):
            if plan.budget <= 0:
                break
            if request.state is RequestState.RUNNING and request.is_prefilling:
                remaining = request.num_tokens - request.num_computed
                self._plan_tokens(plan, request, min(remaining, plan.budget))
        # 3. New (and preempted) requests.
        self._admit(plan)
        # 4. Draft tokens where the gate expects them to pay; identical requests' rows shared.
        if plan.entries:
            for extension in self._extensions:
                extension.extend(plan, self._kv)
        if not plan.entries:
            return None
        self._counters.steps += 1
        batch = plan.batch()
        self._inflight = batch
        return batch

    def commit(
        self,
        batch: Batch,
        next_tokens: Sequence[int | Sequence[int]],
        hit_stop_string: Container[Request] = (),
    ) -> list[Request]:
        """Apply a forward pass's results; returns the requests it finished.

        ``next_tokens`` holds one item per entry: the sampled token, or for an entry with a
        draft the tokens its verification accepted (the matching drafts, then the model's own
        next token), which are appended one by one. Here, and only here, a request is found
        finished (``Request.finish_reason_after``): on a stop token, on reaching
        max_new_tokens, or when it is in ``hit_stop_string`` (its text, with this step's last
        token, holds a stop string: the caller's detokeniser reports); tokens after the one
        that finished it are dropped.
        """
        if batch is not self._inflight:
            raise ValueError("batch: not the batch returned by the last schedule()")
        if len(next_tokens) != len(batch.entries):
            raise ValueError(
                f"next_tokens: expected {len(batch.entries)} tokens (one per entry), "
                f"got {len(next_tokens)}"
            )
        self._inflight = None
        counters = self._counters
        finished: list[Request] = []
        for entry, token in zip(batch.entries, next_tokens):
            request = entry.request
            if request.state is not RequestState.RUNNING:
                continue  # finished or aborted since schedule()
            decode = entry.is_decode
            if entry.draft:
                if self._commit_verified(entry, token, request in hit_stop_string):
                    finished.append(request)
                continue
            request.num_computed = entry.kv_len
            if entry.scored:
                request.scored = entry.scored.stop
            if not decode:
                counters.computed_prefill_tokens += len(entry.input_ids)
            if entry.sample:
                token = int(token[0]) if isinstance(token, Sequence) else int(token)
                request.output.append(token)
                counters.generated_tokens += 1
                if request.first_token_time is None:
                    request.first_token_time = time.monotonic()
                reason = request.finish_reason_after(token, request in hit_stop_string)
                if reason is not None:
                    self._finish(request, reason)
                    finished.append(request)
                    continue
            if not decode:
                self._cache_computed(request)
        return finished

    def _commit_verified(
        self, entry: BatchEntry, tokens: int | Sequence[int], stop_string: bool
    ) -> bool:
        """Append a verified draft's accepted tokens one by one; True if one finished it.

        The K/V of the fed token and of the accepted drafts stays (``num_computed`` counts
        them); the rows of rejected drafts are garbage in the request's private pages, never
        cached, overwritten when those positions are computed for real."""
        request = entry.request
        accepted = [int(t) for t in tokens] if isinstance(tokens, Sequence) else [int(tokens)]
        for extension in self._extensions:
            extension.committed(entry, accepted)
        counters = self._counters
        for index, token in enumerate(accepted):
            request.output.append(token)
            request.num_computed = entry.start_pos + index + 1
            counters.generated_tokens += 1
            last = index == len(accepted) - 1
            reason = request.finish_reason_after(token, stop_string and last)
            if reason is not None:
                self._finish(request, reason)
                return True
        return False

    def observe_step(self, batch: Batch, seconds: float) -> None:
        """The forward pass (and sampling) of ``batch`` took ``seconds``: what the speculation
        gate weighs draft tokens against."""
        if self._speculation is not None:
            self._speculation.observe_step(batch, seconds)

    def _finish(self, request: Request, reason: str) -> None:
        self._release(request, keep=True)
        self._retire(request, RequestState.FINISHED, reason)
        self._record_finish(request)

    def discard(self, batch: Batch) -> None:
        """Forget a scheduled batch that was not run (its pages stay with its requests)."""
        if batch is not self._inflight:
            raise ValueError("batch: not the batch returned by the last schedule()")
        self._inflight = None

    def check_integrity(self) -> None:
        """Raise AssertionError unless every page is owned exactly once (``KVManager.check``
        over the running requests' handles) and no waiting request holds any KV."""
        for request in self._running:
            assert request.state is RequestState.RUNNING, f"{request.id}: running but {request.state}"
            assert request.kv is not None, f"{request.id}: running without KV"
            assert request.num_computed <= len(request.kv.pages) * self._page_size, (
                f"{request.id}: computed tokens beyond its pages"
            )
        self._kv.check(request.kv for request in self._running if request.kv is not None)
        for request in itertools.chain(self._resume, self._queue.candidates()):
            assert request.state is RequestState.WAITING
            assert request.kv is None, f"{request.id}: waiting with KV"

    # ------------------------------------------------------------------ planning

    def _plan_tokens(self, plan: StepPlan, request: Request, n: int) -> None:
        """Add ``n`` tokens of ``request`` to the plan, getting pages for them.

        A prefill chunk shrinks to the pages that can be had; when not even one token fits,
        pins end (oldest first), then the newest running request is preempted until it does
        (or this one is the newest).
        """
        p = self._page_size
        start = request.num_computed
        kv = request.kv
        assert kv is not None
        self._kv.slide(kv, start)  # window slots behind this step's queries are not read again
        if n > 1:
            room = len(kv.pages) + self._kv.growable
            n = max(1, min(n, room * p - start))
        while not self._kv.allocate(kv, start + n):
            if self._kv.pins.release_oldest():
                continue  # a pin gives way before a running request is preempted
            victim = self._preemption_victim()
            self._preempt(victim, plan)
            if victim is request:
                return
        scored = range(0)
        if request.scores_prompt:
            scored = range(max(start, request.scored), min(start + n, len(request.prompt) - 1))
        sample = start + n == request.num_tokens
        plan.place(request, _token_slice(request, start, start + n), start, kv.pages, sample,
                   scored=scored)
        plan.budget -= n

    def _admit(self, plan: StepPlan) -> None:
        """Admit preempted requests (strictly first), then waiting ones in policy order."""
        cfg = self._config
        p = self._page_size
        if plan.budget <= 0 or len(self._running) >= cfg.max_running or not self.num_waiting:
            return
        committed = sum(self._outstanding_pages(r) for r in self._running)
        while self._resume:
            if plan.budget <= 0 or len(self._running) >= cfg.max_running:
                return
            request = self._resume.head()
            admitted = self._try_admit(plan, request, committed)
            if admitted is None:
                return  # head of line: nothing overtakes a preempted request
            if request.state is not RequestState.RUNNING:
                self._resume.pop_head()  # it preempted itself and is queued again: once
                return
            committed = admitted
            self._resume.pop_head()
            if request.state is RequestState.RUNNING:
                self._queue.running_started(request)
        claims = PrefillClaims(p, cfg.group_min_pages)
        for request in self._running:
            if cfg.prefix_cache and request.is_prefilling:
                claims.claim(request.all_tokens, request.kv.cached_len, self._anchor(request))
        matches = self._matches
        admitted_now: list[Request] = []
        lookahead = cfg.max_lookahead
        for request in self._queue.candidates():
            if plan.budget <= 0 or len(self._running) >= cfg.max_running or lookahead <= 0:
                break
            match = matches.get(request)
            tokens = request.all_tokens
            cap = matchable_length(request, p)
            if claims.covers(tokens, match.length, cap, match.anchor):
                self._counters.grouped_deferrals += 1
                lookahead -= 1
                continue
            result = self._try_admit(plan, request, committed)
            if result is None:
                break  # the best candidate does not fit: wait rather than let others overtake
            committed = result
            admitted_now.append(request)
            if cfg.prefix_cache and request.state is RequestState.RUNNING and request.is_prefilling:
                claims.claim(tokens, request.kv.cached_len, self._anchor(request))
        for request in admitted_now:
            if request.state is RequestState.RUNNING:
                self._queue.running_started(request)
            self._queue.remove(request)
            matches.remove(request)

    def _try_admit(self, plan: StepPlan, request: Request, committed: int) -> int | None:
        """Admit ``request`` if memory allows; returns the new committed page count."""
        tokens = request.all_tokens
        matchable = tokens[: matchable_length(request, self._page_size)]
        kv = self._kv.acquire(matchable, request.namespace)  # locked: nothing evicts it now
        need = self._projected_pages(request) - len(kv.pages)
        if committed + need > self._kv.available or self._kv.growable < 1:
            # (``growable``: a window-aware pool may have pool pages but no window slot free
            # for the first new page until running requests slide on or end)
            self._kv.release(kv)
            return None
        # Pages below the pool come back now, before the request computes anything: a load
        # takes the pool pages its recomputation would have (admission counted them).
        loaded = self._kv.load(kv, matchable)
        request.state = RequestState.RUNNING
        request.kv = kv
        request.num_computed = kv.cached_len
        self._running[request] = None
        if not request.admitted:
            request.admitted = True
            request.admitted_time = time.monotonic()
            request.cached_tokens = kv.cached_len
            request.cached_tokens_below = loaded.total
            counters = self._counters
            counters.prompt_tokens += len(request.prompt)
            counters.cached_tokens += kv.cached_len
            counters.cached_tokens_host += loaded.host
            counters.cached_tokens_disk += loaded.disk
            counters.cached_tokens_remote += loaded.remote
        remaining = len(tokens) - kv.cached_len
        self._plan_tokens(plan, request, min(remaining, plan.budget))
        if request.state is not RequestState.RUNNING:
            return committed  # preempted itself: nothing fits after all (cannot happen)
        return committed + self._outstanding_pages(request)

    # ------------------------------------------------------------------ memory

    def _projected_pages(self, request: Request) -> int:
        """Pages ``request`` is expected to hold at its end (decode reserve included)."""
        remaining_new = request.max_new_tokens - len(request.output)
        estimate = math.ceil(remaining_new * self.reserve_ratio)
        most = len(request.prompt) + request.max_new_tokens - 1
        return pages_for(min(most, request.num_tokens + estimate), self._page_size)

    def _outstanding_pages(self, request: Request) -> int:
        held = len(request.kv.pages) if request.kv is not None else 0
        return max(0, self._projected_pages(request) - held)

    def _cache_computed(self, request: Request) -> None:
        """Hand the computed whole pages to the tree, so requests waiting on the same prefix
        hit it next step."""
        assert request.kv is not None
        self._kv.cache(request.kv, _token_slice(request, 0, request.num_computed))

    # ------------------------------------------------------------------ state changes

    def _release(self, request: Request, keep: bool) -> None:
        """Take ``request`` off the running set; its computed whole pages go to the tree when
        ``keep``, its private pages back to the free list."""
        assert request.kv is not None
        computed = _token_slice(request, 0, request.num_computed) if keep else None
        self._kv.release(request.kv, computed)
        request.kv = None
        del self._running[request]
        self._queue.running_ended(request)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        plan.drop(request)
        self._release(request, keep=True)
        request.state = RequestState.WAITING
        request.num_computed = 0
        request.num_preemptions += 1
        self._counters.preemptions += 1
        self._preemption_boost = 1.0
        self._resume.push(request)

    def _preemption_victim(self) -> Request:
        """The running request to preempt: the worst priority (the largest number), the
        newest admitted among those."""
        worst = max(r.params.priority for r in self._running)
        return next(r for r in reversed(self._running) if r.params.priority == worst)

    def _anchor(self, request: Request) -> Hashable:
        """Where a running request's tree part ends: its last tree page, or the root."""
        kv = request.kv
        assert kv is not None
        if kv.cached_len == 0:
            return root_anchor(request.namespace)
        return kv.pages[kv.cached_len // self._page_size - 1]

    def _push_waiting(self, request: Request) -> None:
        match = self._matches.add(request)
        self._queue.push(request, match.length)

    def _drop_waiting(self, request: Request) -> None:
        if request in self._matches:
            self._matches.remove(request)
            self._queue.remove(request)
        else:
            self._resume.remove(request)

    def _retire(self, request: Request, state: RequestState, reason: str) -> None:
        for extension in self._extensions:
            extension.forget(request, finished=state is RequestState.FINISHED)
        request.state = state
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        del self._live[request.id]

    def _record_finish(self, request: Request) -> None:
        self._counters.finished += 1
        fraction = len(request.output) / request.max_new_tokens
        self._generated_fraction += _RATIO_EMA_WEIGHT * (fraction - self._generated_fraction)


# ---------------------------------------------------------------------- helpers


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """``(prompt + output)[start:end]`` without building the concatenation."""
    prompt = request.prompt
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output[start - n : end - n]
    return prompt[start:] + request.output[: end - n]
