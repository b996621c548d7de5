"""Load or recompute: a page comes back from a tier only when that is faster.

Both sides are measured as the engine runs: seconds per page of each tier's loads (read,
verify, copy into the pool) and seconds per token of prefill-sized forward passes. Until a
side has a measurement, loading is assumed to pay (it does by a wide margin on every machine
seen so far: a page is ~0.7 MB against ~4 GFLOP). A tier judged too slow is still tried once
in ``RETRY_EVERY`` refusals, so a judgement made on a cold or busy disk can change.
"""

from __future__ import annotations

from radix.tiers.record import Tier

EWMA_WEIGHT = 0.2
RETRY_EVERY = 64
# A page loaded from each tier costs about this share of recomputing it (2-core EPYC, float32:
# ~0.4 ms from host memory, ~1-1.5 ms from disk, ~35 ms to recompute): what a router assumes
# of its replicas (``cluster.tier_cost``), which measure their own (``LoadCost``).
TYPICAL_LOAD_SHARE = {Tier.HOST: 0.02, Tier.DISK: 0.05, Tier.REMOTE: 0.1}


class LoadCost:
    def __init__(self, page_size: int) -> None:
        self._page_size = page_size
        self._load_s: dict[Tier, float] = {}
        self._compute_s_per_token: float | None = None
        self._refusals: dict[Tier, int] = {}

    @property
    def compute_s_per_page(self) -> float | None:
        if self._compute_s_per_token is None:
            return None
        return self._compute_s_per_token * self._page_size

    def load_s_per_page(self, tier: Tier) -> float | None:
        return self._load_s.get(tier)

    def observe_load(self, tier: Tier, pages: int, seconds: float) -> None:
        if pages > 0:
            self._load_s[tier] = _ewma(self._load_s.get(tier), seconds / pages)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._compute_s_per_token = _ewma(self._compute_s_per_token, seconds / tokens)

    def pays(self, tier: Tier) -> bool:
        """True when loading a page from ``tier`` is expected to beat recomputing it."""
        load, compute = self._load_s.get(tier), self.compute_s_per_page
        if load is None or compute is None or load < compute:
            return True
        refusals = self._refusals.get(tier, 0) + 1
        self._refusals[tier] = refusals % RETRY_EVERY
        return refusals == RETRY_EVERY


def _ewma(old: float | None, value: float) -> float:
    return value if old is None else old + EWMA_WEIGHT * (value - old)
