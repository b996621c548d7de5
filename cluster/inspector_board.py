"""Where the replicas' inspector snapshots meet the front: ``InspectorBoard``.

The front cannot ask one chosen replica for anything (Serve's router picks), so while
someone watches ``/inspect`` each replica takes a snapshot on its engine loop once a second
and posts it here, and the front reads them all. Nobody watching (no read for ``watch_s``),
the replicas take none. Plain Python: ``cluster.serve`` runs it as a Ray actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

WATCH_S = 30.0
# A replica that has posted nothing for this long is gone (killed, replaced).
SILENT_S = 10.0


class InspectorBoard:
    """The latest snapshot of each replica, and whether anyone reads them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._snapshots: dict[str, Any] = {}
        self._posted: dict[str, float] = {}
        self._budget: int | None = None
        self._read_at = float("-inf")

    def wanted(self) -> int | None:
        """The node budget the front last asked for while someone watches, else None."""
        return self._budget if self._clock() - self._read_at < WATCH_S else None

    def post(self, replica: str, snapshot: Any) -> None:
        self._snapshots[replica] = snapshot
        self._posted[replica] = self._clock()

    def forget(self, replica: str) -> None:
        self._snapshots.pop(replica, None)
        self._posted.pop(replica, None)

    def read(self, budget: int) -> dict[str, Any]:
        """Every live replica's latest snapshot; the replicas go on posting, at ``budget``."""
        now = self._clock()
        self._read_at, self._budget = now, budget
        for replica, posted in list(self._posted.items()):
            if now - posted > SILENT_S:
                self.forget(replica)
        return dict(self._snapshots)
