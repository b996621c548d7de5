"""The engine loop's side of the inspector: misses named at admission, snapshots on demand.

Everything here runs on the loop thread, between passes: ``admitted`` after each
``schedule()`` (one check per batch entry, a hash and short reads per newly admitted
request), ``answer`` when a caller's ``InspectOrder`` comes through the loop's inbox (a tree
snapshot bounded by the order's node budget). The caller waits on the order's future in its
own thread; the loop never waits for it.
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from dataclasses import dataclass, field

from engine.api.inspector import InspectSnapshot
from engine.serving.stats import snapshot
from radix.misses import MissTracker
from radix.snapshot import snapshot_tree
from scheduler import Batch, Request, Scheduler
from scheduler.matching import matchable_length


@dataclass(eq=False)
class InspectOrder:
    """A snapshot of at most ``budget`` tree nodes; the loop answers on ``answer``."""

    budget: int
    answer: concurrent.futures.Future[InspectSnapshot] = field(
        default_factory=concurrent.futures.Future
    )


class LoopInspection:
    """Names each admitted request's misses and takes snapshots, for one scheduler."""

    def __init__(self, scheduler: Scheduler, keep: int = 64) -> None:
        self._scheduler = scheduler
        self._misses = MissTracker(scheduler.kv, keep=keep)
        self._seen: weakref.WeakSet[Request] = weakref.WeakSet()

    def admitted(self, batch: Batch) -> None:
        """Record the requests this batch admitted for the first time (their handles still
        end where admission matched them: nothing is cached before the pass)."""
        page_size = self._scheduler.kv.page_size
        seen = self._seen
        for entry in batch.entries:
            request = entry.request
            if not request.admitted or request.num_preemptions or request in seen:
                continue
            seen.add(request)
            handle = request.kv
            if handle is None:
                continue
            self._misses.admitted(
                request.prompt,
                request.namespace,
                request.cached_tokens,
                matchable_length(request, page_size),
                handle.node,
            )

    def answer(self, order: InspectOrder, failed: int) -> None:
        """Take the snapshot ``order`` asks for and hand it over."""
        if not order.answer.set_running_or_notify_cancel():
            return
        started = time.perf_counter()
        try:
            tree = snapshot_tree(self._scheduler.kv, order.budget)
            requests = list(self._misses.recent)
            stats = snapshot(self._scheduler, failed)
        except Exception as exc:  # a bad budget: the caller's error, not the loop's
            order.answer.set_exception(exc)
            return
        order.answer.set_result(
            InspectSnapshot(time.time(), time.perf_counter() - started, tree, requests, stats)
        )
