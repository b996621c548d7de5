"""KV tiers below the pool: a host-memory store and a crash-safe disk store of pages, keyed by
the tree's xxhash chain (see hierarchy.py)."""

from __future__ import annotations

from radix.tiers.changes import TierChanged
from radix.tiers.cost import LoadCost
from radix.tiers.disk import DiskStore
from radix.tiers.hierarchy import KVTiers, PageIO, TierStats
from radix.tiers.host import HostStore
from radix.tiers.record import EvictedPage, FetchedPage, PageRecord, Tier, TierHit
from radix.tiers.remote import RemoteClient, RemoteStore

__all__ = [
    "DiskStore",
    "EvictedPage",
    "FetchedPage",
    "HostStore",
    "KVTiers",
    "LoadCost",
    "PageIO",
    "PageRecord",
    "RemoteClient",
    "RemoteStore",
    "Tier",
    "TierChanged",
    "TierHit",
    "TierStats",
]
