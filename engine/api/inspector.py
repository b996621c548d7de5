"""What the inspector reads of one engine: ``InspectSnapshot``, taken on its loop thread.

A record of the seam (the HTTP server and a replica's front read it; neither walks the tree):
the bounded tree picture (``radix.snapshot``), the last admitted requests with the reason the
rest of each prompt was computed (``radix.misses``), and the engine's stats at that moment.
"""

from __future__ import annotations

import msgspec

from engine.api.stats import EngineStats
from radix.misses import RequestMiss
from radix.snapshot import TreeSnapshot


class InspectSnapshot(msgspec.Struct, frozen=True):
    """One engine as the loop saw it at ``taken_at`` (wall clock); ``loop_s``: how long the
    loop thread spent taking it (its stall)."""

    taken_at: float
    loop_s: float
    tree: TreeSnapshot
    requests: list[RequestMiss]
    stats: EngineStats
