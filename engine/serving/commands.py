"""What callers ask of the engine loop: typed commands queued in its inbox.

Callers on any thread never touch the scheduler or the KV manager; they post one of these and
the loop handles it between passes. Those that wait for an answer carry a future; if the loop
stops before it handles them, ``refuse`` ends the wait with the loop's error.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from engine.serving.job import Job
from radix.pins import Pin


@dataclass(frozen=True, eq=False)
class Submit:
    """Add ``job``'s request to the scheduler."""

    job: Job


@dataclass(frozen=True)
class Abort:
    """Abort a request wherever it is; its caller gets finish_reason "abort"."""

    request_id: Any


@dataclass(eq=False)
class Order:
    """A command its caller waits on: the loop answers on ``answer``."""

    answer: concurrent.futures.Future[Any] = field(
        default_factory=concurrent.futures.Future, kw_only=True
    )

    def refuse(self, error: BaseException) -> None:
        """The loop stopped before it answered: the caller's wait ends with ``error``."""
        if self.answer.set_running_or_notify_cancel():
            self.answer.set_exception(error)


@dataclass(eq=False)
class PinPrefix(Order):
    """Pin the cached prefix of ``tokens`` in ``namespace`` for ``ttl`` seconds; ``answer``
    gets the pin (a ``radix.pins.Pin``), or None when nothing of it is cached."""

    tokens: list[int]
    namespace: str | None
    ttl: float


@dataclass(frozen=True, eq=False)
class Unpin:
    """End ``pin`` now (nothing if it already ended)."""

    pin: Pin


@dataclass(frozen=True, eq=False)
class UnpinPrefix:
    """End the pins of ``namespace`` on the path of ``tokens`` (nothing if there are none)."""

    tokens: list[int]
    namespace: str | None


@dataclass(eq=False)
class Inspect(Order):
    """A snapshot of at most ``budget`` tree nodes for the inspector; ``answer`` gets it (an
    ``engine.api.InspectSnapshot``)."""

    budget: int


Command = Submit | Abort | PinPrefix | Unpin | UnpinPrefix | Inspect
# Commands that only end something: dropped quietly once the loop has stopped.
ENDING = (Abort, Unpin, UnpinPrefix)
