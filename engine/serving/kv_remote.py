"""The remote KV tier's server: Redis (or Valkey), reached by a ``redis://`` URL.

``redis://[:password@]host:port/db`` and ``rediss://`` (TLS) are handed to the ``redis``
client as they are, so auth and TLS are the server's. Calls time out quickly (a slow server is
a miss, see ``radix.tiers.remote``), and the store's budget is the server's own: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` and it drops the least recently used pages
itself (a dropped page is a miss).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

TIMEOUT_S = 0.25  # connect and each call: a step never waits longer on the network


def check_url(url: str) -> str:
    """``url`` if it is a redis:// or rediss:// URL, else a ValueError naming ``kv_remote``."""
    if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss"):
        raise ValueError(
            f"kv_remote: expected redis://[:password@]host:port/db or rediss://..., got {url!r}"
        )
    if not urlsplit(url).hostname:
        raise ValueError(f"kv_remote: no host in {url!r}")
    return url


class RedisClient:
    """The ``RemoteClient`` of ``radix.tiers.remote`` over one Redis connection pool."""

    def __init__(self, url: str, timeout_s: float = TIMEOUT_S) -> None:
        import redis

        self._redis = redis.Redis.from_url(
            check_url(url), socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
        )

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(self._redis.mget(list(keys)))

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value)
        pipe.execute()

    def capacity_bytes(self) -> int | None:
        """The server's ``maxmemory`` (None: unbounded, or the server cannot be asked)."""
        try:
            return int(self._redis.info("memory").get("maxmemory", 0)) or None
        except Exception:  # noqa: BLE001 - down at start: the tier is misses until it is up
            return None

    def close(self) -> None:
        self._redis.close()
