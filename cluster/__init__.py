"""Beyond one engine: replicas, their KV events, and the cache-aware router.

``events``, ``index`` and ``policy`` are plain Python (the simulator runs them); ``serve``
puts them on Ray Serve (imported only where Ray is installed).
"""

from cluster.events import KVEventBatch, KVEventPublisher, KVSnapshot, PageTier
from cluster.index import KVIndex, ReplicaView
from cluster.policy import (
    POLICY_NAMES,
    CacheAware,
    LeastLoaded,
    RoundRobin,
    RouteRequest,
    RoutingPolicy,
    TextPrefixAffinity,
)
from cluster.tier_cost import TierCost

__all__ = [
    "POLICY_NAMES",
    "CacheAware",
    "KVEventBatch",
    "KVEventPublisher",
    "KVIndex",
    "KVSnapshot",
    "LeastLoaded",
    "PageTier",
    "ReplicaView",
    "RoundRobin",
    "RouteRequest",
    "RoutingPolicy",
    "TextPrefixAffinity",
    "TierCost",
]
