"""RequestHandle: what ``EngineClient.submit`` returns, and the one way every caller waits;
HandleSink: its other end, where the request's producer puts its events.

``RequestHandle.open`` makes the pair. The producer (the engine loop thread, or
``RemoteEngine`` relaying a replica's stream) puts text deltas, then one final output or
error, into the sink; the caller takes them from the handle in any thread (``result``,
iteration) or coroutine (``aresult``, ``async for``). ``generate``, ``stream``, their async
forms, chat sessions and ``fork`` are all built on it, so aborts and errors are handled in one
place, and no producer builds the final events by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

from engine.api.errors import EngineDeadError
from engine.api.outputs import RequestOutput, TokenLogprob


@dataclass(frozen=True)
class Delta:
    """New text of a streaming request, with the tokens generated since the previous delta
    (their log-probabilities too, when the request asked). Tokens whose text is held back
    (a partial character, a possible stop string) arrive with a later delta; those of the
    last delta's tail are in the final output only. A request that asked for its prompt's
    log-probabilities gets them with its first delta (``RequestOutput.prompt_logprobs``)."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class Done:
    """The request finished (stop, length or abort); the last event of a request."""

    output: RequestOutput


@dataclass(frozen=True)
class Failed:
    """The request failed with ``error``; the last event of a request."""

    error: BaseException


Event = Delta | Done | Failed


@contextlib.contextmanager
def abort_on_exit(handles: Iterable[RequestHandle]) -> Iterator[None]:
    """Leaving the block by any way (an error, KeyboardInterrupt, a cancelled task, a client
    gone) aborts every handle in ``handles`` that has not finished; read at exit, so a list
    filled inside the block counts. Every caller that submits and waits exits this way."""
    try:
        yield
    finally:
        for handle in handles:
            handle.abort()  # a no-op once it finished


class RequestHandle:
    """One submitted request: its events, its result and its abort. One consumer at a time.

    Made in a thread that runs an asyncio event loop, the handle also wakes that loop on every
    event; once that loop is closed, delivery fails and the engine aborts the request (nobody
    is left to hear of it).
    """

    @classmethod
    def open(
        cls, request_id: int, abort: Callable[[int], None]
    ) -> tuple[RequestHandle, HandleSink]:
        """A new request's handle (for its caller) and sink (for its producer); ``abort`` is
        called with ``request_id`` when the caller gives up before the end."""
        handle = cls(request_id, abort)
        return handle, HandleSink(handle)

    def __init__(self, request_id: int, abort: Callable[[int], None]) -> None:
        self.id = request_id
        self._abort = abort
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._events: deque[Event] = deque()
        self._finished = False  # the final event has been put
        self._consumed = False  # the final event has been taken
        self._final: Event | None = None  # kept once taken: asking again gets it again
        try:
            self._event_loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._event_loop = None
        self._waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ the caller's side

    @property
    def finished(self) -> bool:
        """True once the request finished, failed or was aborted."""
        return self._finished

    def abort(self) -> None:
        """Stop the request wherever it is and free its pages (safe from any thread); its
        result then has finish_reason "abort". A no-op once it finished."""
        if not self._finished:
            self._abort(self.id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request ends; its output, or its error raised here."""
        return _output_or_raise(self.final_event(timeout))

    async def aresult(self) -> RequestOutput:
        """``result`` for asyncio."""
        return _output_or_raise(await self.afinal_event())

    def __iter__(self) -> Iterator[str | RequestOutput]:
        """Text deltas (submitted with ``stream=True``), then the RequestOutput. Leaving the
        loop early (``break``, an exception, ``close()``) aborts the request."""
        try:
            while True:
                event = self._get(None)
                if isinstance(event, Delta):
                    yield event.text
                    continue
                yield _output_or_raise(event)
                return
        finally:
            if not self._consumed:
                self.abort()

    async def __aiter__(self) -> AsyncIterator[str | RequestOutput]:
        """``__iter__`` for asyncio; cancelling the consuming task aborts the request."""
        events = self.events()
        try:
            async for item in events:
                yield item.text if isinstance(item, Delta) else item
        finally:
            await events.aclose()  # aborts unless the output was taken

    async def events(self) -> AsyncIterator[Delta | RequestOutput]:
        """``async for`` over the raw deltas (text with token ids), then the RequestOutput;
        leaving early or cancelling aborts the request (the server's way in)."""
        try:
            while True:
                event = await self._aget()
                if isinstance(event, Delta):
                    yield event
                    continue
                yield _output_or_raise(event)
                return
        finally:
            if not self._consumed:
                self.abort()

    def final_event(self, timeout: float | None = None) -> Event:
        """The final event (Done or Failed), skipping deltas; raises TimeoutError."""
        while True:
            event = self._get(timeout)
            if not isinstance(event, Delta):
                return event

    async def afinal_event(self) -> Event:
        while True:
            event = await self._aget()
            if not isinstance(event, Delta):
                return event

    # ------------------------------------------------------------------ the sink's side

    def _deliver(self, event: Event) -> None:
        """Deliver an event (``HandleSink.put``; never blocks). Raises RuntimeError when the
        caller's event loop is closed."""
        with self._lock:
            self._events.append(event)
            if not isinstance(event, Delta):
                self._finished = True
            self._ready.notify_all()
            waiter, self._waiter = self._waiter, None
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(_wake, waiter)

    # ------------------------------------------------------------------ internals

    def _take(self) -> Event:
        """The next event; after the final one was taken, the final one again (a result
        read twice, as a future's is)."""
        if not self._events:
            assert self._final is not None
            return self._final
        event = self._events.popleft()
        if not isinstance(event, Delta):
            self._consumed = True
            self._final = event
        return event

    def _ready_to_take(self) -> bool:
        return bool(self._events) or self._final is not None

    def _get(self, timeout: float | None) -> Event:
        with self._lock:
            if not self._ready.wait_for(self._ready_to_take, timeout):
                raise TimeoutError(f"request {self.id}: no result within {timeout} s")
            return self._take()

    async def _aget(self) -> Event:
        loop = asyncio.get_running_loop()
        if self._event_loop is None:
            self._event_loop = loop
        while True:
            with self._lock:
                if self._ready_to_take():
                    return self._take()
                waiter = self._waiter = loop.create_future()
            await waiter


class HandleSink:
    """Where one request's producer puts its events: deltas, then ``finish`` or ``fail``,
    once (what comes after the final event is never read). Any thread; never blocks. Each
    call raises RuntimeError when the caller's event loop is closed (nobody is left to
    hear, so the producer aborts the request)."""

    __slots__ = ("_handle",)

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle

    @property
    def finished(self) -> bool:
        """True once the final event was put."""
        return self._handle.finished

    def put(self, event: Event) -> None:
        """Any event, as it is (a producer that queues its events before delivering them)."""
        self._handle._deliver(event)

    def delta(self, delta: Delta) -> None:
        """New text of a streaming request."""
        self._handle._deliver(delta)

    def finish(self, output: RequestOutput) -> None:
        """The request ended (stop, length or abort) with ``output``."""
        self._handle._deliver(Done(output))

    def fail(self, error: BaseException) -> None:
        """The request failed; its caller gets ``error`` raised."""
        self._handle._deliver(Failed(error))


class TextStream:
    """What ``Engine.stream`` returns: text deltas, then the RequestOutput.

    The request is submitted on the first ``next()`` (a stream never started costs nothing).
    ``close()`` aborts it and is safe from any thread, also while another thread waits in
    ``next()`` (which then gets the aborted output). A ``break`` does not tell an iterator
    anything: the request runs on while the stream is referenced, and is aborted when it is
    closed or dropped. ``on_output``, when set, is called with the final output before it is
    yielded, and what it returns is yielded instead (a chat session's parsed tool calls).
    """

    def __init__(self, start: Callable[[], RequestHandle]) -> None:
        self._start = start
        self.on_output: Callable[[RequestOutput], RequestOutput] | None = None
        self._handle: RequestHandle | None = None
        self._items: Iterator[str | RequestOutput] | None = None
        self._closed = False

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str | RequestOutput:
        if self._items is None:
            if self._closed:
                raise StopIteration
            self._handle = self._start()
            self._items = iter(self._handle)
        item = next(self._items)
        if isinstance(item, RequestOutput) and self.on_output is not None:
            item = self.on_output(item)
        return item

    def close(self) -> None:
        self._closed = True
        if self._handle is not None:
            self._handle.abort()

    def __del__(self) -> None:
        self.close()


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _output_or_raise(event: Event) -> RequestOutput:
    if isinstance(event, Done):
        return event.output
    assert isinstance(event, Failed), f"not a final event: {event!r}"
    error = event.error
    if isinstance(error, EngineDeadError):
        # One instance reaches many waiters: raise a fresh one each, same message and cause.
        raise EngineDeadError(str(error)) from error.__cause__
    raise error


def outputs_or_raise(events: list[Event]) -> list[RequestOutput]:
    """Every output, or the first failure raised (after all requests ended)."""
    for event in events:
        if isinstance(event, Failed):
            _output_or_raise(event)
    return [_output_or_raise(e) for e in events]
