"""``PrefixPin``: what ``Engine.pin`` returns, a cached prefix kept in the pool for a while.

A leaf type of the seam: the pin itself lives in the engine's KV manager (``radix.pins``) and
is touched only on the engine loop's thread; this handle holds how to end it, nothing more.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any


class PrefixPin:
    """``tokens`` cached tokens of a prompt pinned until ``expires`` (``time.monotonic()``'s
    clock), or 0 tokens when nothing of the prompt was cached (then there is nothing to keep
    and ``unpin`` does nothing). The pin can still end early: past the engine's
    ``max_pinned_fraction`` of the pool the oldest pin of the namespace pinning the most
    pages is released first.

    ``unpin()`` (or leaving a ``with`` block) releases it at once; its pages become ordinary
    cached pages again, evicted in LRU order (and written down to the KV tiers, where there
    are tiers)."""

    def __init__(
        self, tokens: int, expires: float, release: Callable[[], None] | None
    ) -> None:
        self.tokens = tokens
        self.expires = expires
        self._release = release
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Not yet unpinned by this handle (the engine may have ended it by its budget)."""
        return self._release is not None

    def unpin(self) -> None:
        """End the pin now; a second call does nothing."""
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> PrefixPin:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.unpin()

    def __repr__(self) -> str:
        return f"PrefixPin(tokens={self.tokens}, expires={self.expires:.1f}, active={self.active})"


MAX_PIN_TTL_S = 30 * 24 * 3600.0  # a pin's longest lifetime: 30 days


def check_pin_ttl(ttl: Any, field: str = "ttl", required: bool = False) -> float | None:
    """A pin's lifetime in seconds: a number in (0, MAX_PIN_TTL_S] (None passes unless
    ``required``: no pin); ValueError names ``field``."""
    if ttl is None:
        if required:
            raise ValueError(f"{field}: required, seconds in (0, {MAX_PIN_TTL_S:.0f}]")
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not (
        math.isfinite(ttl) and 0 < ttl <= MAX_PIN_TTL_S
    ):
        raise ValueError(
            f"{field}: must be a number of seconds in (0, {MAX_PIN_TTL_S:.0f}] (30 days), "
            f"got {ttl!r}"
        )
    return float(ttl)
