"""The inspector's last minutes: finished requests and counter samples in time buckets, with
the hit rate, nearest-rank percentiles and each tier's tokens per bucket."""

from __future__ import annotations

import dataclasses

import msgspec

from engine.api import EngineStats, RequestOutput
from server.inspector.traffic import TrafficLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def output(prompt: int, cached: int, ttft: float, itl: list[float]) -> RequestOutput:
    return RequestOutput(text="", token_ids=[1] * (len(itl) + 1), finish_reason="stop",
                         prompt_tokens=prompt, cached_tokens=cached, ttft_s=ttft,
                         latency_s=1.0, itl_s=itl)


def test_buckets_hold_the_hit_rate_percentiles_and_throughput_of_their_requests() -> None:
    clock = Clock()
    log = TrafficLog(window_s=60, clock=clock)
    for i in range(1, 11):
        log.observe(output(100, 50, ttft=i / 10, itl=[0.01 * i]))
    clock.now += 15  # the next bucket
    log.observe(output(100, 100, ttft=0.05, itl=[]))
    buckets = log.series(bucket_s=10)
    assert len(buckets) == 6 and buckets[-1].end == clock.now
    earlier, last = buckets[-2], buckets[-1]
    assert earlier.requests == 10 and earlier.hit_rate == 0.5
    assert earlier.ttft_p50 == 0.5 and earlier.ttft_p95 == 1.0
    assert earlier.itl_p50 == 0.05
    assert earlier.tokens_per_s == 20 / 10
    assert last.requests == 1 and last.hit_rate == 1.0 and last.itl_p50 is None
    assert all(b.hit_rate is None for b in buckets[:-2])


def test_counter_samples_become_tokens_per_tier_evictions_and_restores() -> None:
    clock = Clock()
    log = TrafficLog(window_s=60, clock=clock)
    zero = EngineStats.zero()
    log.sample(zero)
    clock.now += 5
    counters = zero.counters.__class__(prompt_tokens=300, cached_tokens=200,
                                       cached_tokens_host=40, cached_tokens_disk=10,
                                       cached_tokens_remote=30)
    grown = msgspec.structs.replace(
        zero, counters=counters, pages=dataclasses.replace(zero.pages, evicted=7),
        tiers=dataclasses.replace(zero.tiers, loaded_host=3, loaded_remote=2),
    )
    log.sample(grown)
    log.sample(grown)  # within a second of the last: not kept
    last = log.series(bucket_s=10)[-1]
    tiers = (last.pool_tokens, last.host_tokens, last.disk_tokens, last.remote_tokens)
    assert tiers == (120, 40, 10, 30)  # the shared store's tokens are not the pool's
    assert last.computed_tokens == 100
    assert (last.evicted_pages, last.restored_pages) == (7, 5)


def test_what_left_the_window_is_not_counted() -> None:
    clock = Clock()
    log = TrafficLog(window_s=30, clock=clock)
    log.observe(output(10, 10, ttft=0.1, itl=[]))
    clock.now += 45
    assert sum(b.requests for b in log.series(bucket_s=10)) == 0
