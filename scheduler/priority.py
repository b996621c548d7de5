"""Request priority (vLLM's meaning: lower runs first) over any waiting-queue policy.

Waiting requests are kept in one policy queue per priority level (``SamplingParams.priority``);
candidates come level by level, each level in its policy's order (longest cached prefix first
for lpm), so priority never breaks the cache-aware order among equals, and traffic of one
priority schedules exactly as it did without levels.

Starvation is bounded by wall time, not steps (a step's length depends on the load): a level's
place is its oldest request's ``arrival_time`` plus its priority times ``aging_seconds``
(ties: the better priority first). That key does not change while the level's oldest request
waits, so the non-empty levels stay sorted by it (one ``SortedList``) instead of being sorted
on every walk. A request is therefore never overtaken by a level whose requests all arrived
more than (its priority - theirs) x ``aging_seconds`` after it, however busy that level is.
``aging_seconds`` 0: strict priority (a low one may starve).

A level is kept only while it holds requests, waiting or running (a policy that weighs running
requests, dfs-weight, counts them while they run), so what a walk and the memory cost follow
the levels in use, not every priority ever seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from scheduler.policy import WaitingQueue
from scheduler.request import Request


@dataclass(eq=False)
class _Level:
    queue: WaitingQueue
    waiting: SortedList = field(default_factory=SortedList)  # (arrival_time, arrival)
    running: set[Request] = field(default_factory=set)  # now running: keep the level alive
    key: tuple[float, int] | None = None  # its place in ``PriorityLevels._order`` (None: out)


class PriorityLevels(WaitingQueue):
    """A ``WaitingQueue`` of ``make_queue()`` queues, one per priority level in use."""

    def __init__(self, make_queue: Callable[[], WaitingQueue], aging_seconds: float) -> None:
        self._make_queue = make_queue
        self._aging = aging_seconds
        self._levels: dict[int, _Level] = {}
        self._order: SortedList = SortedList()  # (place, priority) of levels with waiting ones
        self._size = 0

    @property
    def num_levels(self) -> int:
        """Levels held now: those with a request waiting or running."""
        return len(self._levels)

    def _level(self, priority: int) -> _Level:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _Level(self._make_queue())
        return level

    def _replace(self, priority: int, level: _Level) -> None:
        """Re-place ``level`` after its oldest waiting request changed; drop it once unused."""
        if level.key is not None:
            self._order.remove(level.key)
            level.key = None
        if level.waiting:
            oldest = level.waiting[0][0]
            place = priority if self._aging <= 0 else oldest + priority * self._aging
            level.key = (place, priority)
            self._order.add(level.key)
        elif not level.running:
            del self._levels[priority]

    def push(self, request: Request, match_length: int) -> None:
        priority = request.params.priority
        level = self._level(priority)
        level.queue.push(request, match_length)
        entry = (request.arrival_time, request.arrival)
        level.waiting.add(entry)
        self._size += 1
        if entry == level.waiting[0]:
            self._replace(priority, level)

    def remove(self, request: Request) -> None:
        priority = request.params.priority
        level = self._levels[priority]
        level.queue.remove(request)
        entry = (request.arrival_time, request.arrival)
        was_oldest = entry == level.waiting[0]
        level.waiting.remove(entry)
        self._size -= 1
        if was_oldest or not level.waiting:
            self._replace(priority, level)

    def update(self, request: Request, match_length: int) -> None:
        self._levels[request.params.priority].queue.update(request, match_length)

    def running_started(self, request: Request) -> None:
        # A preempted request resumes without passing through here: its level may be gone.
        level = self._level(request.params.priority)
        level.running.add(request)
        level.queue.running_started(request)

    def running_ended(self, request: Request) -> None:
        priority = request.params.priority
        level = self._levels.get(priority)
        if level is None or request not in level.running:
            return  # it never started (preempted while being admitted)
        level.running.discard(request)
        level.queue.running_ended(request)
        if not level.running and not level.waiting:
            del self._levels[priority]

    def candidates(self) -> Iterator[Request]:
        levels = self._levels
        for _, priority in self._order:
            yield from levels[priority].queue.candidates()

    def __len__(self) -> int:
        return self._size
