"""What the loop thread sends to a waiting caller, and the channels it sends them through."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass
from typing import Protocol

from engine.outputs import RequestOutput


@dataclass(frozen=True)
class Delta:
    """New text of a streaming request."""

    text: str


@dataclass(frozen=True)
class Done:
    """The request finished (stop, length or abort); the last event of a request."""

    output: RequestOutput


@dataclass(frozen=True)
class Failed:
    """The request failed with ``error``; the last event of a request."""

    error: BaseException


Event = Delta | Done | Failed


class Sink(Protocol):
    """Where the loop thread puts a request's events; ``put`` must never block."""

    def put(self, event: Event) -> None: ...


class ThreadSink:
    """Events for a caller blocked in a plain thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def put(self, event: Event) -> None:
        self._queue.put(event)

    def get(self) -> Event:
        return self._queue.get()


class AsyncSink:
    """Events for a coroutine: handed over to its event loop thread-safely.

    ``put`` raises RuntimeError once the event loop is closed; the engine loop then treats
    the request as failed (nobody is left to receive it) and aborts it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def get(self) -> Event:
        return await self._queue.get()
