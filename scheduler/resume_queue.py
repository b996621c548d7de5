"""Preempted requests, best priority then oldest arrival first: admitted before anything new,
head of line."""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from scheduler.request import Request


class ResumeQueue:
    """Requests sorted by (``params.priority``, ``arrival``) (one list, ``bisect``)."""

    def __init__(self) -> None:
        self._requests: list[Request] = []

    def push(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=lambda r: (r.params.priority, r.arrival))

    def head(self) -> Request:
        return self._requests[0]

    def pop_head(self) -> Request:
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)
