"""What the tiers below the KV pool hold: one page's KV under its content address."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Tier(str, Enum):
    """Where a page's KV can be found (the pool itself is the tree's business)."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"  # a store shared by every engine of the model (radix/tiers/remote.py)


@dataclass(frozen=True, slots=True)
class PageRecord:
    """One page's KV below the pool.

    ``key`` is the page's xxhash chain value (namespace-seeded: it names the whole prefix up to
    and including this page, so equal keys mean equal KV); ``tokens`` are the page's own
    tokens as canonical bytes, compared again on every load so that a 64-bit collision is a
    miss, never wrong KV; ``data`` is the page's KV in the engine's layout (opaque here).
    """

    key: int
    tokens: bytes
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class EvictedPage:
    """A page leaving the pool: its pool id (still holding its KV), content address and
    tokens, so the hierarchy can write it down before the id is reused."""

    page: int
    key: int
    tokens: bytes


@dataclass(frozen=True, slots=True)
class TierHit:
    """A page of a prompt found below the pool: its key, its tokens, and where it is."""

    key: int
    tokens: bytes
    tier: Tier


@dataclass(frozen=True, slots=True)
class FetchedPage:
    """A record read from ``tier`` for a load, and the seconds the read took."""

    record: PageRecord
    tier: Tier
    read_s: float
