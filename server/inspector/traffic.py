"""The last minutes of traffic as the inspector plots them: ``TrafficLog``.

Two bounded rings, both kept by the app's event loop: every finished request's numbers
(its time to first token, gaps between tokens, prompt, cached and generated tokens), fed by
``ServerState.observe``; and samples of the engine's monotone counters (tokens from each
tier, evictions, restores), taken when the inspector polls, at most once a second. ``series``
buckets both over a window: hit rate, tokens from each tier, TTFT / ITL percentiles,
throughput, evictions and restores per bucket.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

WINDOW_S = 300.0
BUCKET_S = 10.0
SAMPLE_EVERY_S = 1.0


class FinishedRequest(msgspec.Struct, frozen=True, array_like=True):
    at: float
    ttft_s: float | None
    itl_s: list[float]
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int


class CounterSample(msgspec.Struct, frozen=True, array_like=True):
    at: float
    pool: int  # prompt tokens served from the pool's tree so far
    host: int
    disk: int
    computed: int  # prompt tokens computed (prompt - cached) so far
    evicted_pages: int
    restored_pages: int  # pages loaded back from host memory, disk or the shared store
    remote: int = 0  # prompt tokens loaded from the shared store (--kv-remote) so far


class TrafficBucket(msgspec.Struct, frozen=True):
    """One ``BUCKET_S`` slice ending at ``end`` (wall clock). Latencies in seconds; None
    where nothing was measured."""

    end: float
    requests: int
    hit_rate: float | None
    tokens_per_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    pool_tokens: int
    host_tokens: int
    disk_tokens: int
    computed_tokens: int
    evicted_pages: int
    restored_pages: int
    remote_tokens: int = 0


class TrafficLog:
    """Finished requests and counter samples of the last ``window_s`` seconds."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        max_requests: int = 20_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._requests: deque[FinishedRequest] = deque(maxlen=max_requests)
        self._samples: deque[CounterSample] = deque(maxlen=int(window_s / SAMPLE_EVERY_S) + 2)

    def observe(self, output: Any) -> None:
        """One finished request (a ``RequestOutput``)."""
        self._requests.append(
            FinishedRequest(
                self._clock(),
                output.ttft_s,
                list(output.itl_s),
                output.prompt_tokens,
                output.cached_tokens,
                len(output.token_ids),
            )
        )

    def sample(self, stats: Any) -> None:
        """The engine's counters now (an ``EngineStats``); at most one sample a second."""
        now = self._clock()
        if self._samples and now - self._samples[-1].at < SAMPLE_EVERY_S:
            return
        c = stats.counters
        self._samples.append(
            CounterSample(
                now,
                c.cached_tokens_pool,
                c.cached_tokens_host,
                c.cached_tokens_disk,
                c.prompt_tokens - c.cached_tokens,
                stats.pages.evicted,
                stats.tiers.loaded_host + stats.tiers.loaded_disk + stats.tiers.loaded_remote,
                c.cached_tokens_remote,
            )
        )

    def series(self, bucket_s: float = BUCKET_S) -> list[TrafficBucket]:
        """The window in buckets of ``bucket_s`` seconds, oldest first, the last one ending
        now."""
        now = self._clock()
        count = max(1, int(self._window_s / bucket_s))
        start = now - count * bucket_s
        finished: list[list[FinishedRequest]] = [[] for _ in range(count)]
        for item in self._requests:
            if item.at > start:
                finished[min(int((item.at - start) / bucket_s), count - 1)].append(item)
        deltas = self._sample_deltas(start, bucket_s, count)
        buckets = []
        for i in range(count):
            items = finished[i]
            prompt = sum(r.prompt_tokens for r in items)
            ttfts = sorted(r.ttft_s for r in items if r.ttft_s is not None)
            itls = sorted(gap for r in items for gap in r.itl_s)
            d = deltas[i]
            buckets.append(
                TrafficBucket(
                    end=start + (i + 1) * bucket_s,
                    requests=len(items),
                    hit_rate=sum(r.cached_tokens for r in items) / prompt if prompt else None,
                    tokens_per_s=sum(r.generated_tokens for r in items) / bucket_s,
                    ttft_p50=_percentile(ttfts, 0.50),
                    ttft_p95=_percentile(ttfts, 0.95),
                    itl_p50=_percentile(itls, 0.50),
                    itl_p95=_percentile(itls, 0.95),
                    pool_tokens=d[0],
                    host_tokens=d[1],
                    disk_tokens=d[2],
                    computed_tokens=d[3],
                    evicted_pages=d[4],
                    restored_pages=d[5],
                    remote_tokens=d[6],
                )
            )
        return buckets

    def _sample_deltas(self, start: float, bucket_s: float, count: int) -> list[list[int]]:
        """Counter growth between consecutive samples, put in the bucket of the later one."""
        deltas = [[0] * (len(CounterSample.__struct_fields__) - 1) for _ in range(count)]
        samples = list(self._samples)
        for before, after in zip(samples, samples[1:]):
            if after.at <= start:
                continue
            row = deltas[min(int((after.at - start) / bucket_s), count - 1)]
            for k, name in enumerate(CounterSample.__struct_fields__[1:]):
                row[k] += max(0, getattr(after, name) - getattr(before, name))
        return deltas


def _percentile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank percentile of sorted values (None for none)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
