"""The engine loop: one background thread owns the scheduler, the KV manager and the runner.

Callers (any thread, any event loop) never touch them: they post typed commands
(``engine.serving.commands``) to an inbox and wait on their request's handle. The loop thread
drains the inbox, runs ``schedule -> runner.step -> detokenise -> commit`` (the scheduler's
commit decides which requests finished, stop strings included), and delivers deltas and
final outputs; with nothing to do it checks the page accounting once and sleeps on a
condition (waking when the first pin's lifetime ends).

Failure is contained at the smallest scope that is still safe:
- processing one request raises (its detokeniser, a gone event loop): that request is aborted
  in the scheduler and its caller gets the error; the others go on;
- the forward pass raises: the requests of that batch fail with the error and are aborted;
  after ``MAX_CONSECUTIVE_STEP_FAILURES`` failed passes in a row the model is considered
  broken and the loop dies;
- the scheduler raises (or the idle integrity check fails): its state cannot be trusted, so
  the loop dies, every waiting caller gets an EngineDeadError at once, and later calls raise it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from engine.api import Done, EngineDeadError, EngineStats, Event, Failed
from engine.model.runner import ModelRunner
from engine.model.structured import GrammarError
from engine.serving.commands import (
    Abort,
    Command,
    Inspect,
    Order,
    PinPrefix,
    Submit,
    Unpin,
    UnpinPrefix,
)
from engine.serving.inbox import Inbox
from engine.serving.inspector import LoopInspector
from engine.serving.job import Job
from radix import KVEvent, KVManager
from scheduler import Batch, Request, RequestState, Scheduler

log = logging.getLogger("radixkv.engine")

MAX_CONSECUTIVE_STEP_FAILURES = 3
_NO_TIERS = EngineStats.zero().tiers  # frozen: one serves every snapshot without tiers
# Passes with fewer tokens are decode-bound and would overstate what a page's prefill costs.
PREFILL_SPEED_MIN_TOKENS = 64


class RequestNotAdmittedError(RuntimeError):
    """The scheduler cannot admit a request even with nothing else running."""


class EngineLoop:
    """Runs ``scheduler`` (over ``kv``, its KV manager) and ``runner`` on one daemon thread;
    see the module docstring."""

    def __init__(self, scheduler: Scheduler, kv: KVManager, runner: ModelRunner) -> None:
        self._scheduler = scheduler
        self._kv = kv
        self._runner: ModelRunner | None = runner
        self._inbox = Inbox()
        # Loop-thread state.
        self._taken: deque[Command] = deque()  # taken from the inbox, not yet handled
        self._live: dict[Any, Job] = {}
        self._outbox: list[tuple[Job, Event]] = []
        self._failed = 0
        self._step_failures = 0
        self._stats = self._snapshot()
        self._inspector = LoopInspector(kv, self._snapshot)
        self._platform = runner.platform
        self._platform.on_loop_start()  # the device's settings for serving (CPU: threads, heap)
        self._thread = threading.Thread(target=self._run, name="radixkv-engine-loop", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- caller side (any thread)

    @property
    def inbox(self) -> Inbox:
        """Where callers post commands (``Inbox.post``) for this loop's thread."""
        return self._inbox

    def stats(self) -> EngineStats:
        """The snapshot published by the loop after its latest step (consistent, never torn),
        with the remote KV tier's write counters as they are now: its writer thread sends
        pages after the step that queued them, and an idle loop publishes no new snapshot."""
        stats = self._stats
        tiers = self._kv.tiers
        remote = tiers.remote if tiers is not None else None
        if remote is None:
            return stats
        live = dataclasses.replace(
            stats.tiers, written_remote=remote.written, remote_dropped=remote.dropped,
            remote_errors=remote.errors, remote_corrupt=remote.corrupt,
        )
        return msgspec.structs.replace(stats, tiers=live)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or running and the idle integrity check has passed.

        Returns False on timeout; raises EngineDeadError if the loop has stopped.
        """
        reached = self._inbox.idle.wait(timeout)
        self._inbox.raise_if_stopped()
        return reached

    def subscribe_kv(self, listener: Callable[[KVEvent], None]) -> None:
        """``listener`` gets the KV manager's events on this loop's thread (list append:
        safe while the loop runs)."""
        self._kv.subscribe(listener)

    def num_waiting(self) -> int:
        """Requests queued and not running: submitted but not yet taken in by the loop, plus
        those the scheduler holds waiting (as of its latest step)."""
        return self._inbox.submitted() + self._stats.requests_waiting

    @property
    def alive(self) -> bool:
        return self._inbox.dead is None and self._thread.is_alive()

    def close(self, timeout: float | None = 30.0) -> None:
        """Aborts everything in flight, stops the thread and waits for it."""
        self._inbox.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if not self._thread.is_alive() and self._runner is not None:
                try:
                    self._kv.close()  # the pool's pages to the disk tier, if any
                except Exception as exc:  # closing must not fail: the files stay consistent
                    warnings.warn(f"KV tiers: writing the pool down failed: {exc!r}",
                                  stacklevel=2)
                finally:
                    self._runner = None  # drops the model runner and its KV pool

    # ------------------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # every waiter must hear of any death
            self._die(exc)

    def _serve(self) -> None:
        idle_checked = True
        while True:
            wait = idle_checked and not self._has_work()
            # Idle with pins: wake when the first one ends, so stats() stops counting it.
            expiry = self._kv.pins.next_expiry() if wait else None
            timeout = None if expiry is None else min(
                max(expiry - time.monotonic(), 0.0) + 0.001, threading.TIMEOUT_MAX
            )
            commands, closing = self._inbox.take(wait, timeout)
            self._taken.extend(commands)
            if closing:
                self._shut_down()
                return
            while self._taken:
                self._handle_alone(self._taken.popleft())
            self._kv.pins.expire(time.monotonic())
            if not self._has_work():
                if not idle_checked:
                    self._scheduler.check_integrity()
                    self._platform.on_loop_idle()  # idle: another engine's loop may be busy
                    idle_checked = True
                self._publish()
                self._inbox.mark_idle_unless_queued()
                continue
            idle_checked = False
            batch = self._scheduler.schedule()
            if batch is None:
                self._on_nothing_scheduled()
            else:
                self._inspector.admitted(batch)
                self._step(batch)
            self._publish()

    def _handle_alone(self, command: Command) -> None:
        """``_handle``, where a command that raises fails alone: its caller hears the error,
        every other request and later call goes on (nothing a caller passes kills the loop)."""
        try:
            self._handle(command)
        except Exception as exc:  # noqa: BLE001 - one command's fault, not the loop's
            log.exception("engine loop: %s failed; the engine goes on", type(command).__name__)
            match command:
                case Submit(job) if job.request.id in self._live:
                    self._fail(job, exc)
                case Submit(job):
                    self._failed += 1
                    self._outbox.append((job, Failed(exc)))
                case PinPrefix() | Inspect() if not command.answer.done():
                    command.answer.set_exception(exc)

    def _handle(self, command: Command) -> None:
        match command:
            case Submit(job):
                self._add(job)
            case Abort(request_id):
                job = self._live.get(request_id)
                if job is not None:  # else it finished (or failed) before the abort came
                    self._scheduler.abort(request_id)
                    self._complete(job)
            case PinPrefix():
                self._pin(command)
            case Unpin(pin):
                self._kv.pins.drop(pin)
            case UnpinPrefix(tokens, namespace):
                if self._kv.pins.drop_prefix(tokens, namespace):
                    self._stats = self._snapshot()  # callers see the pins gone
            case Inspect():
                self._inspector.answer(command)

    def _has_work(self) -> bool:
        return bool(self._scheduler.has_work)

    def _add(self, job: Job) -> None:
        self._live[job.request.id] = job
        try:
            self._scheduler.add(job.request)
        except ValueError as exc:  # the scheduler refused this request alone
            self._live.pop(job.request.id, None)
            self._failed += 1
            self._outbox.append((job, Failed(exc)))

    def _pin(self, order: PinPrefix) -> None:
        try:
            pin = self._kv.pins.pin(order.tokens, order.namespace, order.ttl, time.monotonic())
        except ValueError as exc:
            order.answer.set_exception(exc)
        else:
            self._stats = self._snapshot()  # it sees its pin
            order.answer.set_result(pin)

    def _on_nothing_scheduled(self) -> None:
        if self._scheduler.num_running == 0:
            # Waiting requests that cannot be admitted with nothing else running never will be.
            stuck = [j for j in self._live.values() if j.request.state == RequestState.WAITING]
            if stuck and self._kv.pins.release_oldest():
                return  # pins give way to a request that cannot fit beside them: try again
            for job in stuck:
                request = job.request
                error = RequestNotAdmittedError(
                    f"request {request.id!r} ({len(request.prompt)} prompt tokens + "
                    f"max_new_tokens {request.max_new_tokens}) cannot be admitted: "
                    "the KV cache is too small for it"
                )
                self._fail(job, error)
            if stuck:
                return
        self._inbox.pause(0.001)  # nothing runnable right now: do not spin

    def _step(self, batch: Batch) -> None:
        assert self._runner is not None
        try:
            started = time.perf_counter()
            result = self._runner.step(batch)
            seconds = time.perf_counter() - started
            self._observe_speed(batch, seconds)
            self._scheduler.observe_step(batch, seconds)
        except Exception as exc:
            self._step_failures += 1
            if self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            self._scheduler.discard(batch)
            for entry in batch.entries:
                job = self._live.get(entry.request.id)
                if job is not None:
                    self._fail(job, exc)
            return
        self._step_failures = 0
        now = time.monotonic()
        # A grammar llguidance stopped following mid-way masked its row to EOS alone: the
        # request fails (its error names the grammar) rather than end "stop" outside it.
        for request_id, message in result.grammar_errors.items():
            job = self._live.get(request_id)
            if job is not None:
                self._fail(job, GrammarError(message))  # aborted now: commit() skips it
        if result.prompt_logprobs is not None:
            for entry, scores in zip(batch.entries, result.prompt_logprobs):
                job = self._live.get(entry.request.id)
                if scores and job is not None:
                    job.prompt_logprobs.extend(scores)
        # Text first: the detokeniser reports stop strings, which commit() then decides on.
        # An entry may bring several tokens (an accepted draft): a job takes them one by one,
        # up to the first that ends its request.
        sampled: list[tuple[Job, str]] = []
        hit_stop_string: set[Request] = set()
        next_tokens: list[list[int]] = []
        for entry, tokens, logprobs in zip(batch.entries, result.tokens, result.logprobs):
            next_tokens.append(tokens)
            job = self._live.get(entry.request.id)
            if not tokens or job is None:
                continue
            try:
                taken, delta = job.take(tokens, logprobs, now)
            except Exception as exc:
                self._fail(job, exc)  # aborted now: commit() skips it
                continue
            next_tokens[-1] = tokens[:taken]
            if job.detokenizer.stopped:
                hit_stop_string.add(job.request)
            sampled.append((job, delta))
        self._scheduler.commit(batch, next_tokens, hit_stop_string)
        for job, delta in sampled:
            try:
                if job.request.is_done:
                    delta += job.detokenizer.finish()
                if delta and job.stream:
                    self._outbox.append((job, job.delta(delta)))
                if job.request.is_done:
                    self._complete(job)
            except Exception as exc:
                self._fail(job, exc)

    def _observe_speed(self, batch: Batch, seconds: float) -> None:
        """Prefill-sized passes tell the KV tiers what recomputing a page costs."""
        if self._kv.tiers is None:
            return
        tokens = sum(len(entry.input_ids) for entry in batch.entries)
        if tokens >= PREFILL_SPEED_MIN_TOKENS:
            self._kv.observe_compute(tokens, seconds)

    def _complete(self, job: Job) -> None:
        """Hands the caller its output (the request finished or was aborted); a finished
        request that asked is pinned (cached at the finish: whole pages of prompt + output,
        kept for its next turn)."""
        request = job.request
        self._live.pop(request.id, None)
        now = time.monotonic()
        if job.pins_at_finish:
            assert job.pin_ttl is not None
            self._kv.pins.pin([*request.prompt, *request.output], request.namespace,
                              job.pin_ttl, now)
        self._outbox.append((job, Done(job.output(now))))

    def _fail(self, job: Job, error: BaseException) -> None:
        """Aborts one request in the scheduler and hands its caller the error."""
        self._live.pop(job.request.id, None)
        if not job.request.is_done:
            self._scheduler.abort(job.request.id)
        self._failed += 1
        self._outbox.append((job, Failed(error)))

    def _snapshot(self) -> EngineStats:
        """The scheduler's counters and the KV manager's pages, now."""
        tiers = self._kv.tier_stats()
        return EngineStats(
            counters=dataclasses.replace(self._scheduler.counters),  # a copy: they move on
            pages=self._kv.stats(),
            tiers=_NO_TIERS if tiers is None else tiers,
            failed=self._failed,
            requests_running=self._scheduler.num_running,
            requests_waiting=self._scheduler.num_waiting,
        )

    def _publish(self) -> None:
        """Publishes stats, then delivers this iteration's events (so a caller that got its
        output sees stats that include it)."""
        self._stats = self._snapshot()
        while self._outbox:
            outbox, self._outbox = self._outbox, []
            for job, event in outbox:
                try:
                    job.sink.put(event)
                except Exception as exc:  # e.g. the caller's event loop is closed
                    if job.request.id in self._live:
                        self._fail(job, exc)
            if self._outbox:
                self._stats = self._snapshot()

    def _shut_down(self) -> None:
        """Aborts everything: running and waiting requests, and those submitted but never
        added (taken from the inbox with the close, or still there); each caller gets an
        output with finish_reason "abort"."""
        for job in list(self._live.values()):
            self._scheduler.abort(job.request.id)
            self._complete(job)
        for job in self._not_added(EngineDeadError("the engine stopped")):
            self._complete(job)
        self._publish()
        self._inbox.idle.set()

    def _not_added(self, error: EngineDeadError) -> list[Job]:
        """Jobs submitted that never reached the scheduler: taken from the inbox and not yet
        handled, or still in it (emptied here). Orders still waiting for an answer get
        ``error``."""
        commands = [*self._taken, *self._inbox.drain()]
        self._taken.clear()
        jobs = []
        for command in commands:
            if isinstance(command, Submit):
                jobs.append(command.job)
            elif isinstance(command, Order):  # their callers wait on the answer
                command.refuse(error)
        return jobs

    def _die(self, exc: BaseException) -> None:
        self._inbox.die(exc)
        error = EngineDeadError(f"the engine loop died: {exc!r}")
        error.__cause__ = exc
        for job in [*self._live.values(), *self._not_added(error)]:
            try:
                job.sink.put(Failed(error))
            except Exception:  # a caller whose event loop is gone needs no message
                pass
        self._live.clear()
        self._inbox.idle.set()
