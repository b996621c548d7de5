"""The engine loop: one background thread owns the scheduler and the model runner.

Callers (any thread, any event loop) never touch the scheduler: they post commands (add a
job, abort a request) to an inbox and wait on their request's handle. The loop thread drains
the inbox, runs ``schedule -> runner.step -> detokenise -> commit`` (the scheduler's commit
decides which requests finished, stop strings included), and delivers deltas and final
outputs; with nothing to do it checks the page accounting once and sleeps on a condition.

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

import concurrent.futures
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.api import (
    Delta,
    Done,
    EngineDeadError,
    EngineStats,
    Event,
    Failed,
    HandleSink,
    RequestOutput,
    TokenLogprob,
)
from engine.model.runner import ModelRunner
from engine.model.structured import GrammarError
from engine.serving.detokenizer import IncrementalDetokenizer
from engine.serving.inspector import InspectOrder, LoopInspection
from engine.serving.stats import snapshot
from radix import KVEvent
from radix.pins import Pin
from scheduler import Batch, Request, RequestState, Scheduler

MAX_CONSECUTIVE_STEP_FAILURES = 3
# Passes with fewer tokens are decode-bound and would overstate what a page's prefill costs.
PREFILL_SPEED_MIN_TOKENS = 64


class RequestNotAdmittedError(RuntimeError):
    """The scheduler cannot admit a request even with nothing else running."""


@dataclass(eq=False)
class PinOrder:
    """Pin the cached prefix of ``tokens`` in ``namespace`` for ``ttl`` seconds; the loop
    answers on ``answer`` (the pin, or None when nothing of it is cached)."""

    tokens: list[int]
    namespace: str | None
    ttl: float
    answer: concurrent.futures.Future[Pin | None] = field(
        default_factory=concurrent.futures.Future
    )


@dataclass(eq=False)
class Job:
    """A request and what the serving side keeps with it (the scheduler sees the request)."""

    request: Request
    detokenizer: IncrementalDetokenizer
    sink: HandleSink  # where the caller's handle gets its deltas and its end
    stream: bool  # deliver text deltas, not only the final output
    # Log-probabilities of every generated token (requests that asked), and when each came.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Log-probabilities of the prompt's tokens after the first (requests that asked).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    # Tokens generated since the last delta (their text may still be held back).
    unsent: int = 0
    delivered: bool = False  # a delta went out (the first carries the prompt's scores)
    # Pin the request's tokens for this many seconds once it finishes (a stored conversation
    # that should stay warm for its next turn); None: no pin.
    pin_ttl: float | None = None

    def delta(self, text: str) -> Delta:
        """A delta with ``text`` and the tokens (and log-probabilities) not yet sent."""
        n, self.unsent = self.unsent, 0
        ids = self.request.output[len(self.request.output) - n :]
        lps = self.logprobs[len(self.logprobs) - n :] if self.logprobs else []
        scores = None
        if not self.delivered:
            self.delivered = True
            scores = self.prompt_scores()
        return Delta(text, tuple(ids), tuple(lps), None if scores is None else tuple(scores))

    def prompt_scores(self) -> list[TokenLogprob | None] | None:
        """The prompt's log-probabilities, None first (nothing predicts the first token);
        None if the request did not ask for them."""
        if self.request.params.prompt_logprobs is None:
            return None
        return [None, *self.prompt_logprobs]


class EngineLoop:
    """Runs the scheduler and the model on one daemon thread; see the module docstring."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self._scheduler = scheduler
        self._runner: ModelRunner | None = runner
        # Re-entrant: a dropped stream's finaliser aborts its request, and the garbage
        # collector may run it in a thread that already holds this lock.
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._taken: deque[tuple[str, Any]] = deque()  # loop thread: taken, not yet handled
        self._closing = False
        self._dead: BaseException | None = None  # set once; the loop has stopped
        self._idle = threading.Event()
        self._idle.set()  # nothing queued yet
        # Loop-thread state.
        self._live: dict[Any, Job] = {}
        self._outbox: list[tuple[Job, Event]] = []
        self._failed = 0
        self._step_failures = 0
        self._stats: EngineStats = snapshot(scheduler, 0)
        self._inspection = LoopInspection(scheduler)
        self._platform = runner.platform
        self._platform.on_loop_start()  # the device's settings for serving (CPU: threads, heap)
        self._thread = threading.Thread(target=self._run, name="radixkv-engine-loop", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- caller side (any thread)

    def submit(self, job: Job) -> None:
        """Queues a job; raises EngineDeadError if the loop has stopped."""
        with self._lock:
            self._raise_if_stopped()
            self._idle.clear()
            self._inbox.append(("add", job))
            self._wake.notify()

    def abort(self, request_id: Any) -> None:
        """Aborts a request wherever it is; its caller gets finish_reason "abort". No-op when
        the request is already finished or the loop has stopped."""
        self._command("abort", request_id, quiet=True)

    def pin(self, order: PinOrder) -> None:
        """Queues a pin; its answer comes on ``order.answer`` (EngineDeadError if the loop
        stops first)."""
        self._command("pin", order)

    def unpin(self, pin: Pin) -> None:
        """Ends ``pin`` on the loop's thread (no-op once the loop has stopped)."""
        self._command("unpin", pin, quiet=True)

    def inspect(self, order: InspectOrder) -> None:
        """Queues a snapshot for the inspector; the loop answers on ``order.answer`` between
        passes (the caller waits on it with a timeout)."""
        self._command("inspect", order)

    def _command(self, kind: str, payload: Any, quiet: bool = False) -> None:
        """Queues a command for the loop's thread; once the loop has stopped, EngineDeadError
        (``quiet``: nothing, for commands that only end something)."""
        with self._lock:
            if quiet and (self._dead is not None or self._closing):
                return
            self._raise_if_stopped()
            self._inbox.append((kind, payload))
            self._wake.notify()

    def stats(self) -> EngineStats:
        """The snapshot published by the loop after its latest step (consistent, never torn)."""
        return self._stats

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or running and the idle integrity check has passed.

        Returns False on timeout; raises EngineDeadError if the loop has stopped.
        """
        reached = self._idle.wait(timeout)
        with self._lock:
            self._raise_if_stopped()
        return reached

    def subscribe_kv(self, listener: Callable[[KVEvent], None]) -> None:
        """``listener`` gets the KV manager's events on this loop's thread (list append:
        safe while the loop runs)."""
        self._scheduler.kv.subscribe(listener)

    def num_waiting(self) -> int:
        """Requests queued and not running: submitted but not yet taken in by the loop, plus
        those the scheduler holds waiting (as of its latest step)."""
        with self._lock:
            inbox = sum(1 for kind, _ in self._inbox if kind == "add")
        return inbox + self._stats.requests_waiting

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def close(self, timeout: float | None = 30.0) -> None:
        """Aborts everything in flight, stops the thread and waits for it."""
        with self._lock:
            self._closing = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if not self._thread.is_alive() and self._runner is not None:
                try:
                    self._scheduler.kv.close()  # the pool's pages to the disk tier, if any
                except Exception as exc:  # closing must not fail: the files stay consistent
                    warnings.warn(f"KV tiers: writing the pool down failed: {exc!r}",
                                  stacklevel=2)
                finally:
                    self._runner = None  # drops the model runner and its KV pool

    def _raise_if_stopped(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}") from self._dead
        if self._closing:
            raise EngineDeadError("the engine is closed")

    # ------------------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # every waiter must hear of any death
            self._die(exc)

    def _serve(self) -> None:
        idle_checked = True
        while True:
            commands, closing = self._take_commands(wait=idle_checked and not self._has_work())
            self._taken.extend(commands)
            if closing:
                self._shut_down()
                return
            while self._taken:
                kind, payload = self._taken.popleft()
                if kind == "add":
                    self._add(payload)
                elif kind == "inspect":
                    self._inspection.answer(payload, self._failed)
                elif kind == "abort":
                    self._abort(payload)
                elif kind == "pin":
                    self._pin(payload)
                else:
                    self._scheduler.kv.pins.drop(payload)
            self._expire_pins()
            if not self._has_work():
                if not idle_checked:
                    self._scheduler.check_integrity()
                    self._platform.on_loop_idle()  # idle: another engine's loop may be busy
                    idle_checked = True
                self._publish()
                self._mark_idle_if_quiet()
                continue
            idle_checked = False
            batch = self._scheduler.schedule()
            if batch is None:
                self._on_nothing_scheduled()
            else:
                self._inspection.admitted(batch)
                self._step(batch)
            self._publish()

    def _has_work(self) -> bool:
        return bool(self._scheduler.has_work)

    def _take_commands(self, wait: bool) -> tuple[list[tuple[str, Any]], bool]:
        with self._lock:
            while wait and not self._inbox and not self._closing:
                # Idle with pins: wake when the first one ends, so stats() stops counting it.
                expiry = self._scheduler.kv.pins.next_expiry()
                if expiry is None:
                    self._wake.wait()
                else:
                    self._wake.wait(max(expiry - time.monotonic(), 0.0) + 0.001)
                    if self._expire_pins():
                        self._stats = snapshot(self._scheduler, self._failed)
            commands = list(self._inbox)
            self._inbox.clear()
            return commands, self._closing

    def _mark_idle_if_quiet(self) -> None:
        with self._lock:
            if not self._inbox and not self._has_work():
                self._idle.set()

    def _add(self, job: Job) -> None:
        self._live[job.request.id] = job
        try:
            self._scheduler.add(job.request)
        except ValueError as exc:  # the scheduler refused this request alone
            self._live.pop(job.request.id, None)
            self._failed += 1
            self._outbox.append((job, Failed(exc)))

    def _abort(self, request_id: Any) -> None:
        job = self._live.get(request_id)
        if job is None:
            return  # finished (or failed) before the abort arrived
        self._scheduler.abort(request_id)
        self._complete(job)

    def _pin(self, order: PinOrder) -> None:
        try:
            pin = self._scheduler.kv.pins.pin(
                order.tokens, order.namespace, order.ttl, time.monotonic()
            )
        except ValueError as exc:
            order.answer.set_exception(exc)
        else:
            self._stats = snapshot(self._scheduler, self._failed)  # the caller sees its pin
            order.answer.set_result(pin)

    def _expire_pins(self) -> int:
        return len(self._scheduler.kv.pins.expire(time.monotonic()))

    def _on_nothing_scheduled(self) -> None:
        if self._scheduler.num_running == 0:
            # Waiting requests that cannot be admitted with nothing else running never will be.
            stuck = [j for j in self._live.values() if j.request.state == RequestState.WAITING]
            if stuck and self._scheduler.kv.pins.release_oldest():
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
        with self._lock:  # nothing runnable right now: do not spin
            if not self._inbox and not self._closing:
                self._wake.wait(0.001)

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
        grammars = self._runner.grammars
        for request_id, message in (grammars.take_errors() if grammars else {}).items():
            job = self._live.get(request_id)
            if job is not None:
                self._fail(job, GrammarError(message))  # aborted now: commit() skips it
        # Text first: the detokeniser reports stop strings, which commit() then decides on.
        # An entry may bring several tokens (an accepted draft): they are taken one by one,
        # up to the first that ends the request.
        if result.prompt_logprobs is not None:
            for entry, scores in zip(batch.entries, result.prompt_logprobs):
                job = self._live.get(entry.request.id)
                if scores and job is not None:
                    job.prompt_logprobs.extend(scores)
        sampled: list[tuple[Job, str]] = []
        hit_stop_string: set[Request] = set()
        next_tokens: list[list[int]] = []
        for entry, tokens, logprobs in zip(batch.entries, result.tokens, result.logprobs):
            next_tokens.append(tokens)
            job = self._live.get(entry.request.id)
            if not tokens or job is None:
                continue
            try:
                taken, delta = self._take_tokens(job, tokens, logprobs, now)
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

    @staticmethod
    def _take_tokens(
        job: Job, tokens: list[int], logprobs: list[TokenLogprob], now: float
    ) -> tuple[int, str]:
        """Feed a step's tokens for one request to its detokeniser, up to the first that ends
        it by ``Request.end_reason`` (a follower catching up is given its leader's tokens,
        which may run past its own limit). Returns how many were taken and their text."""
        request = job.request
        text = []
        taken = 0
        for index, token in enumerate(tokens):
            taken += 1
            job.token_times.append(now)
            job.unsent += 1
            if index < len(logprobs):
                job.logprobs.append(logprobs[index])
            if not request.is_stop_token(token):  # a stop token's text is not in the reply
                text.append(job.detokenizer.push(token))
            generated = len(request.output) + taken
            if request.end_reason(token, generated, job.detokenizer.stopped) is not None:
                break
        return taken, "".join(text)

    def _observe_speed(self, batch: Batch, seconds: float) -> None:
        """Prefill-sized passes tell the KV tiers what recomputing a page costs."""
        kv = self._scheduler.kv
        if kv.tiers is None:
            return
        tokens = sum(len(entry.input_ids) for entry in batch.entries)
        if tokens >= PREFILL_SPEED_MIN_TOKENS:
            kv.observe_compute(tokens, seconds)

    def _complete(self, job: Job) -> None:
        """Hands the caller its output (the request finished or was aborted)."""
        request = job.request
        self._live.pop(request.id, None)
        now = time.monotonic()
        first = request.first_token_time
        end = request.finish_time if request.finish_time is not None else now
        admitted = request.admitted_time
        times = job.token_times
        output = RequestOutput(
            text=job.detokenizer.text,
            token_ids=list(request.output),
            finish_reason=request.finish_reason or "abort",
            prompt_tokens=len(request.prompt),
            cached_tokens=request.cached_tokens,
            ttft_s=None if first is None else first - request.arrival_time,
            latency_s=end - request.arrival_time,
            queue_s=None if admitted is None else admitted - request.arrival_time,
            itl_s=[b - a for a, b in zip(times, times[1:])],
            logprobs=job.logprobs if request.params.logprobs is not None else None,
            prompt_logprobs=job.prompt_scores(),
        )
        if job.pin_ttl is not None and request.finish_reason not in (None, "abort"):
            # Cached at the finish (whole pages of prompt + output): kept for the next turn.
            self._scheduler.kv.pins.pin(
                [*request.prompt, *request.output], request.namespace, job.pin_ttl, now
            )
        self._outbox.append((job, Done(output)))

    def _fail(self, job: Job, error: BaseException) -> None:
        """Aborts one request in the scheduler and hands its caller the error."""
        self._live.pop(job.request.id, None)
        if not job.request.is_done:
            self._scheduler.abort(job.request.id)
        self._failed += 1
        self._outbox.append((job, Failed(error)))

    def _publish(self) -> None:
        """Publishes stats, then delivers this iteration's events (so a caller that got its
        output sees stats that include it)."""
        self._stats = snapshot(self._scheduler, self._failed)
        while self._outbox:
            outbox, self._outbox = self._outbox, []
            for job, event in outbox:
                try:
                    job.sink.put(event)
                except Exception as exc:  # e.g. the caller's event loop is closed
                    if job.request.id in self._live:
                        self._fail(job, exc)
            if self._outbox:
                self._stats = snapshot(self._scheduler, self._failed)

    def _shut_down(self) -> None:
        """Aborts everything: running and waiting requests, and those submitted but never
        added (taken from the inbox with the close, or still there); each caller gets an
        output with finish_reason "abort"."""
        for job in list(self._live.values()):
            self._scheduler.abort(job.request.id)
            self._complete(job)
        for job in self._not_added():
            self._complete(job)
        self._publish()
        self._idle.set()

    def _not_added(self) -> list[Job]:
        """Jobs submitted that never reached the scheduler: taken from the inbox and not yet
        handled, or still in it (emptied here)."""
        with self._lock:
            commands = [*self._taken, *self._inbox]
            self._taken.clear()
            self._inbox.clear()
        for kind, payload in commands:
            if kind == "pin":  # its caller waits on the answer
                payload.answer.set_exception(EngineDeadError("the engine stopped"))
        return [payload for kind, payload in commands if kind == "add"]

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
        pending = self._not_added()
        error = EngineDeadError(f"the engine loop died: {exc!r}")
        error.__cause__ = exc
        for job in [*self._live.values(), *pending]:
            try:
                job.sink.put(Failed(error))
            except Exception:  # a caller whose event loop is gone needs no message
                pass
        self._live.clear()
        self._idle.set()

