"""The engine loop's side of the inspector: misses named at admission, snapshots on demand.

Everything here runs on the loop thread, between passes: ``admitted`` after each
``schedule()`` (one check per batch entry, a hash and short reads per newly admitted
request), ``answer`` when a caller's ``Inspect`` command comes through the loop's inbox (a
tree snapshot bounded by the command's node budget). The caller waits on the command's
future in its own thread; the loop never waits for it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

from engine.api.inspector import InspectSnapshot
from engine.api.stats import EngineStats
from engine.serving.commands import Inspect
from radix import KVManager
from radix.misses import MissTracker
from radix.snapshot import snapshot_tree
from scheduler import Batch, Request
from scheduler.matching import matchable_length


class LoopInspector:
    """Names each admitted request's misses and takes snapshots of one KV manager's cache
    (with the loop's ``stats`` of the moment)."""

    def __init__(
        self, kv: KVManager, stats: Callable[[], EngineStats], keep: int = 64
    ) -> None:
        self._kv = kv
        self._stats = stats
        self._misses = MissTracker(kv, keep=keep)
        self._seen: weakref.WeakSet[Request] = weakref.WeakSet()

    def admitted(self, batch: Batch) -> None:
        """Record the requests this batch admitted for the first time (their handles still
        end where admission matched them: nothing is cached before the pass)."""
        page_size = self._kv.page_size
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

    def answer(self, order: Inspect) -> None:
        """Take the snapshot ``order`` asks for and hand it over."""
        if not order.answer.set_running_or_notify_cancel():
            return
        started = time.perf_counter()
        try:
            tree = snapshot_tree(self._kv, order.budget)
            requests = list(self._misses.recent)
            stats = self._stats()
        except Exception as exc:  # a bad budget: the caller's error, not the loop's
            order.answer.set_exception(exc)
            return
        order.answer.set_result(
            InspectSnapshot(time.time(), time.perf_counter() - started, tree, requests, stats)
        )
