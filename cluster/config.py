"""What ``radixkv serve --replicas`` deploys, as one checked record (no Ray needed to read it)."""

from __future__ import annotations

from typing import Any

import msgspec

ROUTERS = ("cache_aware", "power_of_two", "prefix_affinity")  # what --router can name


class ClusterConfig(msgspec.Struct, frozen=True):
    """Everything ``build_app`` needs; ``engine`` holds Engine keyword arguments."""

    replicas: int = 2
    threads: int = 1  # CPU threads (and Ray CPUs) per replica
    engine: dict[str, Any] = {}
    router: str = "cache_aware"
    balance_threshold: int = 4
    max_ongoing_requests: int = 64  # Ray's default (5) would starve continuous batching
    hub_name: str = "radixkv-kv-hub"
    model: str | None = None
    server: dict[str, Any] = {}  # ServerConfig keyword arguments

    def check(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if self.router not in ROUTERS:
            raise ValueError(f"router: must be one of {ROUTERS}, got {self.router!r}")
        if self.balance_threshold < 0:
            raise ValueError(f"balance_threshold: must be >= 0, got {self.balance_threshold}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests: must be >= 1, got {self.max_ongoing_requests}")
