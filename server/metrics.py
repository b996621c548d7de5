"""Prometheus metrics, named in vLLM's style so existing dashboards port.

The engine's counters (prefix-cache queries and hits, tokens, preemptions, evicted pages,
speculative decoding's drafts and accepted tokens, by vLLM's ``spec_decode_*`` names) and
gauges (requests, pages) are read from ``EngineClient.stats()`` at scrape time, so they are exactly
the engine's own figures: a prompt's tokens and its cached part are counted once, when the
request is first admitted, however often it waited or was preempted and recomputed.
Per-request figures (latency histograms, finish reasons, rejections) are observed by the
server as requests end. Each app has its own registry: nothing global, two apps in one
process do not mix.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import EngineClient, EngineStats, RequestOutput

PREFIX = "radixkv:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# fmt: off
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
_ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
# fmt: on


class EngineCollector(Collector):
    """The engine's counters and gauges, read at scrape time."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self._engine = engine
        self._labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        c, pages = s.counters, s.pages
        counters = (
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                c.prompt_tokens,
            ),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", c.cached_tokens),
            ("prompt_tokens", "Prompt tokens of admitted requests.", c.prompt_tokens),
            (
                "prefill_computed_tokens",
                "Prefill tokens computed, recomputation after preemption included.",
                c.computed_prefill_tokens,
            ),
            ("generation_tokens", "Tokens generated.", c.generated_tokens),
            (
                "num_preemptions",
                "Requests preempted (their KV freed, to be recomputed).",
                c.preemptions,
            ),
            ("evicted_pages", "KV pages evicted from the prefix cache.", c.evicted_pages),
            ("request_failures", "Requests that failed with an error.", s.failed),
            (
                "kv_pins_released",
                "Pins ended early or on time: their lifetime, the budget, or pages needed.",
                pages.pins_released,
            ),
            (
                "spec_decode_num_drafts",
                "Speculative decoding: drafts verified (one per request and step).",
                c.spec_decode_num_drafts,
            ),
            (
                "spec_decode_num_draft_tokens",
                "Speculative decoding: draft tokens verified.",
                c.spec_decode_num_draft_tokens,
            ),
            (
                "spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens accepted.",
                c.spec_decode_num_accepted_tokens,
            ),
            (
                "shared_rows",
                "Rows a request got from an identical request in flight, computed once.",
                c.shared_rows,
            ),
        )
        gauges = (
            (
                "num_requests_running",
                "Requests running (admitted, holding KV).",
                s.requests_running,
            ),
            ("num_requests_waiting", "Requests waiting to be admitted.", s.requests_waiting),
            ("kv_pages_total", "KV pages in the pool.", pages.total),
            ("kv_pages_free", "KV pages on the free list.", pages.free),
            ("kv_pages_cached", "KV pages held by the prefix cache.", pages.cached),
            ("kv_pages_in_use", "KV pages private to running requests.", pages.private),
            (
                "kv_pages_pinned",
                "KV pages kept by pins (stored conversations, Engine.pin), part of cached.",
                pages.pinned,
            ),
            ("kv_pins", "Live pins.", pages.pins),
            (
                "kv_cache_usage_perc",
                "Share of KV pages not free (0-1).",
                1 - pages.free / pages.total if pages.total else 0.0,
            ),
            ("engine_alive", "1 while the engine loop runs.", int(self._engine.alive)),
        )
        for kind, rows in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
            for name, doc, value in rows:
                family = kind(PREFIX + name, doc, labels=list(self._labels))
                family.add_metric(list(self._labels.values()), value)
                yield family
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the draft (0 first).",
            labels=[*self._labels, "position"],
        )
        for position, count in enumerate(c.spec_decode_num_accepted_tokens_per_pos):
            per_position.add_metric([*self._labels.values(), str(position)], count)
        yield per_position
        yield from self._tier_families(s)

    def _tier_families(self, s: EngineStats) -> Iterator[Metric]:
        """Hits by where they came from (SGLang's ``cached_tokens_total{cache_source}``) and
        the KV tiers' traffic and contents, labelled by tier."""
        names, values = list(self._labels), list(self._labels.values())
        c, t = s.counters, s.tiers
        by_source = CounterMetricFamily(
            PREFIX + "cached_tokens",
            "Prompt tokens served from the cache, by where their KV was: pool, host, disk, remote.",
            labels=[*names, "cache_source"],
        )
        for source, count in (
            ("pool", c.cached_tokens_pool),
            ("host", c.cached_tokens_host),
            ("disk", c.cached_tokens_disk),
            ("remote", c.cached_tokens_remote),
        ):
            by_source.add_metric([*values, source], count)
        yield by_source
        per_tier = (
            (CounterMetricFamily, "kv_tier_pages_written", "KV pages written down to a tier.",
             t.written_host, t.written_disk, t.written_remote),
            (CounterMetricFamily, "kv_tier_pages_loaded", "KV pages loaded back from a tier.",
             t.loaded_host, t.loaded_disk, t.loaded_remote),
            (GaugeMetricFamily, "kv_tier_pages", "KV pages a tier holds.",
             t.host_pages, t.disk_pages, None),
            (GaugeMetricFamily, "kv_tier_bytes", "Bytes of KV a tier holds.",
             t.host_bytes, t.disk_bytes, None),
        )
        for kind, name, doc, host, disk, remote in per_tier:
            family = kind(PREFIX + name, doc, labels=[*names, "tier"])
            family.add_metric([*values, "host"], host)
            family.add_metric([*values, "disk"], disk)
            if remote is not None and t.remote:  # a shared store's size is the server's
                family.add_metric([*values, "remote"], remote)
            yield family
        for name, doc, value in (
            ("kv_tier_pages_dropped", "KV pages that fell off the lowest tier.", t.dropped),
            ("kv_disk_corrupt_files", "Damaged KV page files found (read as misses).",
             t.corrupt),
            ("kv_disk_write_errors", "KV page files the disk tier failed to write (full disk).",
             t.disk_write_errors),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            yield family


class ServerMetrics:
    """The app's registry: the engine's figures plus what the server observes per request."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(engine, model_name))
        labels = ["model_name"]
        self._model = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Gap between successive generated tokens.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to the request's end.", _LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Arrival to first admission.", _LATENCY_BUCKETS
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Requests ended, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused before they ran, by reason.",
            [*labels, "reason"],
            registry=self.registry,
        )

    def observe(self, output: RequestOutput) -> None:
        """One engine request ended (each of a request's n choices counts)."""
        m = self._model
        self.finished.labels(m, output.finish_reason).inc()
        self.e2e.labels(m).observe(output.latency_s)
        if output.ttft_s is not None:
            self.ttft.labels(m).observe(output.ttft_s)
        if output.queue_s is not None:
            self.queue.labels(m).observe(output.queue_s)
        itl = self.itl.labels(m)
        for gap in output.itl_s:
            itl.observe(gap)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
