"""The replicas' engine stats as the front end sums them for ``/metrics``.

Replicas come and go (killed, replaced by Serve, scaled down; and, to the front end, all of
them at once while the KV event hub restarts). A sum of the live ones alone would drop
whatever a departed replica had counted, and Prometheus reads a counter that drops as a
reset. So the last stats of every replica that left stay in the sum as their counts only
(``EngineStats.retired``), until the replica reports again.
"""

from __future__ import annotations

from engine.api import EngineStats


class ReplicaStats:
    """The latest stats by replica, and the counts of those that left."""

    def __init__(self) -> None:
        self.live: dict[str, EngineStats] = {}
        self._departed: dict[str, EngineStats] = {}

    def update(self, live: dict[str, EngineStats]) -> None:
        """The replicas reporting now (the hub's view)."""
        for name, last in self.live.items():
            if name not in live:
                self._departed[name] = last.retired()
        for name in live:
            self._departed.pop(name, None)  # back: its own stats count everything again
        self.live = dict(live)

    def total(self) -> EngineStats | None:
        """Live stats summed with the departed replicas' counts (None before any report):
        every counter in it only grows, whichever replicas come and go."""
        if not self.live and not self._departed:
            return None
        return EngineStats.total([*self.live.values(), *self._departed.values()])
