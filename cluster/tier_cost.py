"""What a replica's cached prefix is worth to a request, by where its pages are.

A page in the pool (device) saves its whole recomputation; a page in host memory or on disk
saves it less the load (``radix.tiers.cost``: a page costs a few percent of its recomputation
to load, disk more than host; one in the remote store, which every replica can load, more
again). So a replica holding a prefix below the pool scores below one
holding it on the device and above one without it, and a deeper run below can outweigh a
shallower one on the device, as it would in prefill time.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from cluster.events import PageTier
from radix.tiers import Tier
from radix.tiers.cost import TYPICAL_LOAD_SHARE


class TierCost(msgspec.Struct, frozen=True):
    """A hit's cost in each place as a share of recomputing the page (device: 0)."""

    host: float = TYPICAL_LOAD_SHARE[Tier.HOST]
    disk: float = TYPICAL_LOAD_SHARE[Tier.DISK]
    remote: float = TYPICAL_LOAD_SHARE[Tier.REMOTE]

    def __post_init__(self) -> None:
        for name in ("host", "disk", "remote"):
            share = getattr(self, name)
            if not 0.0 <= share < 1.0:
                raise ValueError(f"{name}: must be in [0, 1), got {share!r}")
        if self.disk < self.host:
            raise ValueError(f"disk: must cost at least host ({self.host}), got {self.disk}")

    def saved(self, run: Sequence[PageTier]) -> float:
        """Recomputations (in pages) a request saves by reusing ``run``."""
        host = disk = remote = 0
        for tier in run:
            if tier is PageTier.HOST:
                host += 1
            elif tier is PageTier.DISK:
                disk += 1
            elif tier is PageTier.REMOTE:
                remote += 1
        device = len(run) - host - disk - remote
        return (
            device
            + host * (1.0 - self.host)
            + disk * (1.0 - self.disk)
            + remote * (1.0 - self.remote)
        )
