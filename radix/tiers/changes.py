"""TierChanged: the keys a tier below the pool gained or lost, for whoever follows the KV
without asking the stores (a replica's KV-event publisher, which tells the router where a page
is: a page evicted from the pool but written down has moved, not gone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radix.tiers.record import Tier


@dataclass(frozen=True, slots=True)
class TierChanged:
    """``tier`` now holds ``added`` (content addresses) and no longer holds ``removed``."""

    tier: Tier
    added: Sequence[int]
    removed: Sequence[int]


# What a store calls on every change of its keys: (added, removed), on the caller's thread.
StoreWatcher = Callable[[Sequence[int], Sequence[int]], None]
