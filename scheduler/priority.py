"""Request priority (vLLM's meaning: lower runs first) over any waiting-queue policy.

Waiting requests are kept in one policy queue per priority level (``SamplingParams.priority``);
candidates come level by level, each level in its policy's order (longest cached prefix first
for lpm), so priority never breaks the cache-aware order among equals, and traffic of one
priority schedules exactly as it did without levels.

Starvation is bounded by age: a level's effective priority is its priority minus one for every
``aging_steps`` scheduler steps its oldest request has waited, and levels are offered in that
order (ties: the better priority first). A level that keeps waiting behind a busier, better one
overtakes it after ``aging_steps`` times their difference, plus the better one's own age.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from sortedcontainers import SortedList

from scheduler.policy import WaitingQueue
from scheduler.request import Request


class PriorityLevels(WaitingQueue):
    """A ``WaitingQueue`` of ``make_queue()`` queues, one per priority level present."""

    def __init__(self, make_queue: Callable[[], WaitingQueue], aging_steps: int) -> None:
        self._make_queue = make_queue
        self._aging_steps = aging_steps
        self._levels: dict[int, WaitingQueue] = {}
        self._since: dict[int, SortedList] = {}  # per level: (step enqueued, arrival)
        self._entered: dict[Request, int] = {}
        self._step = 0

    def advance(self) -> None:
        """One scheduler step went by (the clock the aging counts)."""
        self._step += 1

    def effective(self, priority: int) -> int:
        """Level ``priority``'s place now: its priority less the age of its oldest request."""
        since = self._since.get(priority)
        if not since or self._aging_steps <= 0:
            return priority
        return priority - (self._step - since[0][0]) // self._aging_steps

    def push(self, request: Request, match_length: int) -> None:
        level = request.params.priority
        queue = self._levels.get(level)
        if queue is None:
            queue = self._levels[level] = self._make_queue()
            self._since[level] = SortedList()
        queue.push(request, match_length)
        self._entered[request] = self._step
        self._since[level].add((self._step, request.arrival))

    def remove(self, request: Request) -> None:
        level = request.params.priority
        # An emptied level stays: a policy that weighs running requests (dfs-weight) keeps
        # counting its requests while they run.
        self._levels[level].remove(request)
        self._since[level].remove((self._entered.pop(request), request.arrival))

    def update(self, request: Request, match_length: int) -> None:
        self._levels[request.params.priority].update(request, match_length)

    def running_started(self, request: Request) -> None:
        queue = self._levels.get(request.params.priority)
        if queue is not None:
            queue.running_started(request)

    def running_ended(self, request: Request) -> None:
        queue = self._levels.get(request.params.priority)
        if queue is not None:
            queue.running_ended(request)

    def candidates(self) -> Iterator[Request]:
        order = sorted(self._levels, key=lambda level: (self.effective(level), level))
        for level in order:
            yield from self._levels[level].candidates()

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._levels.values())
