"""The engine loop's inbox: where callers on any thread post commands and see the loop's state.

Everything callers and the loop thread share is here, behind one lock: the queued commands,
whether the loop is closing or has died, and whether it is idle. The loop thread takes the
commands in batches between passes and sleeps here when it has nothing to do.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from engine.api import EngineDeadError
from engine.serving.commands import ENDING, Abort, Command, Submit


class Inbox:
    """Commands from callers to one engine loop, and the loop's closing, death and idleness."""

    def __init__(self) -> None:
        # Re-entrant: a dropped stream's finaliser aborts its request, and the garbage
        # collector may run it in a thread that already holds this lock.
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._commands: deque[Command] = deque()
        self.closing = False
        self.dead: BaseException | None = None  # set once: the loop has stopped
        self.idle = threading.Event()
        self.idle.set()  # nothing queued yet

    def post(self, command: Command) -> None:
        """Queues ``command``. Once the loop has stopped: EngineDeadError, except for
        commands that only end something (``Abort``, ``Unpin``), which are dropped."""
        with self._lock:
            if isinstance(command, ENDING) and self.stopped:
                return
            self.raise_if_stopped()
            if isinstance(command, Submit):
                self.idle.clear()
            self._commands.append(command)
            self._wake.notify()

    def abort(self, request_id: object) -> None:
        """Aborts a request wherever it is (what a handle's ``abort`` calls); nothing once it
        finished or the loop stopped."""
        self.post(Abort(request_id))

    @property
    def stopped(self) -> bool:
        return self.dead is not None or self.closing

    def raise_if_stopped(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead!r}") from self.dead
        if self.closing:
            raise EngineDeadError("the engine is closed")

    def submitted(self) -> int:
        """Requests posted and not yet taken by the loop."""
        with self._lock:
            return sum(1 for command in self._commands if isinstance(command, Submit))

    # ------------------------------------------------------------------------------ loop thread

    def take(self, wait: bool, timeout: float | None = None) -> tuple[list[Command], bool]:
        """Every queued command, and whether the loop is closing. With ``wait``, first sleeps
        until a command comes, the loop is closed, or ``timeout`` seconds (None: no limit)."""
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            while wait and not self._commands and not self.closing:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._wake.wait(remaining)
            commands = list(self._commands)
            self._commands.clear()
            return commands, self.closing

    def pause(self, seconds: float) -> None:
        """Nothing is runnable now: sleep ``seconds`` unless a command or the close comes."""
        with self._lock:
            if not self._commands and not self.closing:
                self._wake.wait(seconds)

    def mark_idle_unless_queued(self) -> None:
        """The loop has nothing to run: idle, unless a command came meanwhile."""
        with self._lock:
            if not self._commands:
                self.idle.set()

    def drain(self) -> list[Command]:
        """Empties the inbox (the loop is stopping) and returns what was in it."""
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def close(self) -> None:
        with self._lock:
            self.closing = True
            self._wake.notify()

    def die(self, error: BaseException) -> None:
        with self._lock:
            self.dead = error
