"""The scheduler: which requests run next, how many of their tokens, and on which pages.

One step = ``schedule()`` (plan a batch: decodes, prefill chunks of running requests, then
admissions in policy order, all within ``max_batch_tokens`` and ``max_running``) followed by
``commit()`` (append sampled tokens, insert computed prefixes into the tree, finish requests).

Page ownership, at every moment: each page is free, in the tree, or in exactly one running
request's private tail. A running request's page table is ``tree part + private tail``: the
tree part (``request.tree_len`` tokens) is the path to ``request.node``, which the request
keeps locked; the tail holds tokens computed since, or allocated for this step.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from radix import Node, PageAllocator, RadixCache
from scheduler.batch import Batch, BatchEntry
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.grouping import PrefillClaims
from scheduler.matching import MatchIndex, matchable_length, root_anchor
from scheduler.policy import make_queue
from scheduler.request import Request, RequestState

# Weight of one finished request in the moving average of the generated fraction.
_RATIO_EMA_WEIGHT = 0.1


@dataclass
class _StepPlan:
    budget: int
    entries: dict[Request, BatchEntry] = field(default_factory=dict)


class Scheduler:
    """Continuous batching with chunked prefill, prefix-aware admission and preemption.

    The scheduler must be the only one that inserts into and evicts from ``cache`` (it tracks
    the waiting requests' matches through those calls) and the only user of ``allocator``.
    """

    def __init__(
        self,
        cache: RadixCache,
        allocator: PageAllocator,
        config: SchedulerConfig | None = None,
    ) -> None:
        config = config if config is not None else SchedulerConfig(page_size=cache.page_size)
        if config.page_size != cache.page_size:
            raise ValueError(
                f"page_size: config has {config.page_size}, the cache {cache.page_size}"
            )
        self._cache = cache
        self._allocator = allocator
        self._config = config
        self._page_size = config.page_size
        self._queue = make_queue(config.policy, config.page_size)
        self._matches = MatchIndex(cache)
        self._resume: list[Request] = []  # preempted requests, oldest arrival first
        self._resume_keys: list[int] = []  # their arrivals (bisect index)
        self._running: dict[Request, None] = {}  # admission order: the last is the newest
        self._live: dict[int | str, Request] = {}  # waiting or running, by id
        self._arrivals = itertools.count()
        self._counters = SchedulerCounters()
        self._generated_fraction = config.reserve_ratio_init
        self._preemption_boost = 0.0
        self._inflight: Batch | None = None

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def counters(self) -> SchedulerCounters:
        """A snapshot of the monotone counters."""
        return replace(self._counters)

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

    def get(self, request_id: int | str) -> Request | None:
        """A waiting or running request."""
        return self._live.get(request_id)

    def add(self, request: Request) -> None:
        """Queue a new request (state WAITING)."""
        if request.state is not RequestState.WAITING or request.admitted:
            raise ValueError(f"request: must be a new WAITING request, got {request.state.value}")
        if request.id in self._live:
            raise ValueError(f"request.id: {request.id!r} is already queued or running")
        if not isinstance(request.prompt, list):
            request.prompt = list(request.prompt)
        if not request.prompt:
            raise ValueError("request.prompt: must hold at least 1 token, got 0")
        if not isinstance(request.max_new_tokens, int) or request.max_new_tokens < 1:
            raise ValueError(
                f"request.max_new_tokens: must be an int >= 1, got {request.max_new_tokens!r}"
            )
        pages = _pages_for(len(request.prompt) + request.max_new_tokens - 1, self._page_size)
        if pages > self._allocator.num_pages:
            raise ValueError(
                f"request.prompt: {len(request.prompt)} tokens + max_new_tokens "
                f"{request.max_new_tokens} need {pages} KV pages, the pool has "
                f"{self._allocator.num_pages}"
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

    def finish(self, request_id: int | str, reason: str = "stop") -> Request | None:
        """Finish a request the engine found done (a stop string), as on a stop token."""
        request = self._live.get(request_id)
        if request is None:
            return None
        if request.state is RequestState.RUNNING:
            self._release(request, keep=True)
        else:
            self._drop_waiting(request)
        self._retire(request, RequestState.FINISHED, reason)
        self._record_finish(request)
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

        plan = _StepPlan(budget=cfg.max_batch_tokens)
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
        if not plan.entries:
            return None
        self._counters.steps += 1
        batch = Batch(entries=list(plan.entries.values()), page_size=self._page_size)
        self._inflight = batch
        return batch

    def commit(self, batch: Batch, next_tokens: Sequence[int]) -> list[Request]:
        """Apply a forward pass's results; returns the requests it finished."""
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
            request.num_computed = entry.kv_len
            if not decode:
                counters.computed_prefill_tokens += len(entry.input_ids)
            if entry.sample:
                token = int(token)
                request.output.append(token)
                counters.generated_tokens += 1
                if request.first_token_time is None:
                    request.first_token_time = time.monotonic()
                reason = None
                if token in request.stop_token_ids:
                    reason = "stop"
                elif len(request.output) >= request.max_new_tokens:
                    reason = "length"
                if reason is not None:
                    self._release(request, keep=True)
                    self._retire(request, RequestState.FINISHED, reason)
                    self._record_finish(request)
                    finished.append(request)
                    continue
            if not decode:
                self._cache_computed(request)
        return finished

    def discard(self, batch: Batch) -> None:
        """Forget a scheduled batch that was not run (its pages stay with its requests)."""
        if batch is not self._inflight:
            raise ValueError("batch: not the batch returned by the last schedule()")
        self._inflight = None

    def check_integrity(self) -> None:
        """Raise AssertionError unless every page is owned exactly once.

        Owners: the allocator's free list, one tree node, or one running request's private
        tail. A running request's tree part must be exactly the path to its locked node; a
        waiting request holds nothing. At idle, free + cached == total and nothing is locked.
        """
        cache, allocator = self._cache, self._allocator
        cache.check_invariants()
        tree_pages = _tree_pages(cache)
        for page in tree_pages:
            assert not allocator.is_free(page), f"page {page} is both free and in the tree"
        private: set[int] = set()
        p = self._page_size
        for request in self._running:
            assert request.state is RequestState.RUNNING, f"{request.id}: running but {request.state}"
            assert request.tree_len % p == 0, f"{request.id}: tree_len not page-aligned"
            shared = request.pages[: request.tree_len // p]
            assert request.node is not None and request.node.own_locks > 0, (
                f"{request.id}: holds no lock on its node"
            )
            assert _path_pages(request.node) == shared, (
                f"{request.id}: page table's tree part differs from its node's path"
            )
            assert request.num_computed <= len(request.pages) * p, (
                f"{request.id}: computed tokens beyond its pages"
            )
            for page in request.pages[request.tree_len // p :]:
                assert page not in private, f"page {page} is private to two requests"
                assert page not in tree_pages, f"page {page} is private and in the tree"
                assert not allocator.is_free(page), f"page {page} is private and free"
                private.add(page)
        total = allocator.num_free + len(tree_pages) + len(private)
        assert total == allocator.num_pages, (
            f"free {allocator.num_free} + tree {len(tree_pages)} + private {len(private)} "
            f"!= {allocator.num_pages} pages"
        )
        for request in itertools.chain(self._resume, self._queue.candidates()):
            assert request.state is RequestState.WAITING
            assert not request.pages and request.node is None, f"{request.id}: waiting with pages"
        if not self._running:
            assert allocator.num_free + cache.cached_pages == allocator.num_pages, "idle leak"
            assert cache.protected_pages == 0, "idle with locked pages"

    # ------------------------------------------------------------------ planning

    def _plan_tokens(self, plan: _StepPlan, request: Request, n: int) -> None:
        """Add ``n`` tokens of ``request`` to the plan, getting pages for them.

        A prefill chunk shrinks to the pages that can be had; when not even one token fits,
        the newest running request is preempted until it does (or this one is the newest).
        """
        p = self._page_size
        start = request.num_computed
        if n > 1:
            room = (len(request.pages) + self._allocator.num_free + self._cache.evictable_pages)
            n = max(1, min(n, room * p - start))
        while not self._ensure_pages(request, start + n):
            victim = next(reversed(self._running))
            self._preempt(victim, plan)
            if victim is request:
                return
        tokens = _token_slice(request, start, start + n)
        pages = request.pages[: _pages_for(start + n, p)]
        slots = [pages[pos // p] * p + pos % p for pos in range(start, start + n)]
        sample = start + n == request.num_tokens
        plan.entries[request] = BatchEntry(request, tokens, start, pages, slots, sample)
        plan.budget -= n

    def _admit(self, plan: _StepPlan) -> None:
        """Admit preempted requests (strictly first), then waiting ones in policy order."""
        cfg = self._config
        p = self._page_size
        if plan.budget <= 0 or len(self._running) >= cfg.max_running or not self.num_waiting:
            return
        committed = sum(self._outstanding_pages(r) for r in self._running)
        while self._resume:
            if plan.budget <= 0 or len(self._running) >= cfg.max_running:
                return
            request = self._resume[0]
            admitted = self._try_admit(plan, request, committed)
            if admitted is None:
                return  # head of line: nothing overtakes a preempted request
            committed = admitted
            self._resume.pop(0)
            self._resume_keys.pop(0)
            if request.state is RequestState.RUNNING:
                self._queue.running_started(request)
        claims = PrefillClaims(p, cfg.group_min_pages)
        for request in self._running:
            if cfg.prefix_cache and request.is_prefilling:
                claims.claim(_tokens(request), request.tree_len, self._anchor(request))
        matches = self._matches
        admitted_now: list[Request] = []
        lookahead = cfg.max_lookahead
        for request in self._queue.candidates():
            if plan.budget <= 0 or len(self._running) >= cfg.max_running or lookahead <= 0:
                break
            match = matches.get(request)
            tokens = _tokens(request)
            cap = matchable_length(len(tokens), p)
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
                claims.claim(tokens, request.tree_len, self._anchor(request))
        for request in admitted_now:
            if request.state is RequestState.RUNNING:
                self._queue.running_started(request)
            self._queue.remove(request)
            matches.remove(request)

    def _try_admit(self, plan: _StepPlan, request: Request, committed: int) -> int | None:
        """Admit ``request`` if memory allows; returns the new committed page count."""
        cache = self._cache
        tokens = _tokens(request)
        cap = matchable_length(len(tokens), self._page_size)
        found = cache.match_prefix(tokens[:cap], request.namespace)
        cache.lock(found.node)  # before anything can evict the matched pages
        need = self._projected_pages(request) - len(found.pages)
        if committed + need > self._allocator.num_free + cache.evictable_pages:
            cache.unlock(found.node)
            return None
        request.state = RequestState.RUNNING
        request.node = found.node
        request.pages = list(found.pages)
        request.tree_len = found.length
        request.num_computed = found.length
        self._running[request] = None
        if not request.admitted:
            request.admitted = True
            request.cached_tokens = found.length
            self._counters.prompt_tokens += len(request.prompt)
            self._counters.cached_tokens += found.length
        remaining = len(tokens) - found.length
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
        return _pages_for(min(most, request.num_tokens + estimate), self._page_size)

    def _outstanding_pages(self, request: Request) -> int:
        return max(0, self._projected_pages(request) - len(request.pages))

    def _ensure_pages(self, request: Request, num_tokens: int) -> bool:
        """Grow ``request``'s page table to hold ``num_tokens`` tokens (evicting if needed)."""
        need = _pages_for(num_tokens, self._page_size) - len(request.pages)
        if need <= 0:
            return True
        pages = self._alloc(need)
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    def _alloc(self, n: int) -> list[int] | None:
        allocator = self._allocator
        short = n - allocator.num_free
        if short > 0:
            if short > self._cache.evictable_pages:
                return None
            freed = self._cache.evict(short)
            allocator.free(freed)
            self._counters.evicted_pages += len(freed)
            self._matches.pages_evicted(freed)
        return allocator.alloc(n)

    def _cache_computed(self, request: Request) -> None:
        """Insert the computed whole pages into the tree and re-point the page table at them.

        The request's pages for tokens the tree already had are duplicates: they are freed and
        replaced by the tree's; its lock moves down to the new node.
        """
        if not self._config.prefix_cache:
            return  # nothing is shared: the request's pages stay private and are freed at the end
        p = self._page_size
        aligned = (request.num_computed // p) * p
        if aligned <= request.tree_len:
            return
        cache = self._cache
        tokens = _token_slice(request, 0, aligned)
        namespace = request.namespace
        num_pages = aligned // p
        already = cache.insert(tokens, request.pages[:num_pages], namespace)
        found = cache.match_prefix(tokens, namespace)
        assert found.length == aligned, "the tree lost a prefix it was just given"
        cache.lock(found.node)
        if request.node is not None:
            cache.unlock(request.node)
        request.node = found.node
        duplicates = request.pages[request.tree_len // p : already // p]
        if duplicates:
            self._allocator.free(duplicates)
        request.pages[:num_pages] = found.pages
        request.tree_len = aligned
        if already < aligned:
            anchor = found.pages[already // p - 1] if already else root_anchor(namespace)
            self._matches.tree_extended(anchor, tuple(tokens[already : already + p]))

    # ------------------------------------------------------------------ state changes

    def _release(self, request: Request, keep: bool) -> None:
        """Take ``request`` off the running set, freeing its tail and dropping its lock."""
        if keep:
            self._cache_computed(request)
        private = request.pages[request.tree_len // self._page_size :]
        if private:
            self._allocator.free(private)
        if request.node is not None:
            self._cache.unlock(request.node)
        request.pages = []
        request.node = None
        request.tree_len = 0
        del self._running[request]
        self._queue.running_ended(request)

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        entry = plan.entries.pop(request, None)
        if entry is not None:
            plan.budget += len(entry.input_ids)
        self._release(request, keep=True)
        request.state = RequestState.WAITING
        request.num_computed = 0
        request.num_preemptions += 1
        self._counters.preemptions += 1
        self._preemption_boost = 1.0
        index = bisect.bisect(self._resume_keys, request.arrival)
        self._resume_keys.insert(index, request.arrival)
        self._resume.insert(index, request)

    def _anchor(self, request: Request) -> Hashable:
        """Where a running request's tree part ends: its last tree page, or the root."""
        if request.tree_len == 0:
            return root_anchor(request.namespace)
        return request.pages[request.tree_len // self._page_size - 1]

    def _push_waiting(self, request: Request) -> None:
        match = self._matches.add(request)
        self._queue.push(request, match.length)

    def _drop_waiting(self, request: Request) -> None:
        if request in self._matches:
            self._matches.remove(request)
            self._queue.remove(request)
        else:
            index = self._resume.index(request)
            del self._resume[index]
            del self._resume_keys[index]

    def _retire(self, request: Request, state: RequestState, reason: str) -> None:
        request.state = state
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        del self._live[request.id]

    def _record_finish(self, request: Request) -> None:
        self._counters.finished += 1
        fraction = len(request.output) / request.max_new_tokens
        self._generated_fraction += _RATIO_EMA_WEIGHT * (fraction - self._generated_fraction)


# ---------------------------------------------------------------------- helpers


def _pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def _tokens(request: Request) -> list[int]:
    """Every token of ``request`` (the prompt itself when nothing was generated yet)."""
    return request.prompt if not request.output else request.prompt + request.output


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """``(prompt + output)[start:end]`` without building the concatenation."""
    prompt = request.prompt
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output[start - n : end - n]
    return prompt[start:] + request.output[: end - n]


def _tree_pages(cache: RadixCache) -> set[int]:
    pages: set[int] = set()
    for namespace in cache.namespaces:
        stack = [cache.root(namespace)]
        while stack:
            node = stack.pop()
            for page in node.pages:
                assert page not in pages, f"page {page} appears twice in the tree"
                pages.add(page)
            stack.extend(node.children.values())
    return pages


def _path_pages(node: Node | None) -> list[int]:
    chunks = []
    while node is not None:
        chunks.append(node.pages)
        node = node.parent
    return [page for chunk in reversed(chunks) for page in chunk]
