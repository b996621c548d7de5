"""What ``radixkv serve --replicas`` deploys, as one checked record (no Ray needed to read it)."""

from __future__ import annotations

import msgspec

from engine import EngineConfig
from server.config import ServerConfig

ROUTERS = ("cache_aware", "power_of_two", "prefix_affinity")  # what --router can name


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``build_app`` needs: each replica's ``EngineConfig`` (its ``threads`` are
    also the replica's Ray CPUs; None counts as 1), the front end's ``ServerConfig``, and how
    requests are routed between them. Checks itself: ValueError names the field."""

    replicas: int = 2
    engine: EngineConfig = EngineConfig(threads=1)
    server: ServerConfig = ServerConfig()
    router: str = "cache_aware"
    balance_threshold: int = 4
    max_ongoing_requests: int = 64  # Ray's default (5) would starve continuous batching
    hub_name: str = "radixkv-kv-hub"

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router: must be one of {ROUTERS}, got {self.router!r}")
        if self.balance_threshold < 0:
            raise ValueError(f"balance_threshold: must be >= 0, got {self.balance_threshold}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests: must be >= 1, got {self.max_ongoing_requests}")

    @property
    def threads(self) -> int:
        """CPU threads (and Ray CPUs) per replica."""
        return self.engine.threads or 1
