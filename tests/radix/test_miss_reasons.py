"""Why an admitted prompt's rest was computed: evicted, another namespace, never seen, or
the page boundary, named from the tree and the evictions it saw."""

from __future__ import annotations

from radix import KVManager
from radix.misses import MissTracker

PAGE = 4


def cached(kv: KVManager, tokens: list[int], namespace: str | None = None) -> None:
    handle = kv.acquire(tokens, namespace)
    assert kv.allocate(handle, len(tokens))
    kv.release(handle, tokens)


def admit(kv: KVManager, misses: MissTracker, tokens: list[int], namespace: str | None = None):
    """What the loop does at admission: the cached prefix (all whole pages but the last
    token's), locked, then named."""
    matchable = ((len(tokens) - 1) // PAGE) * PAGE
    handle = kv.acquire(tokens[:matchable], namespace)
    report = misses.admitted(tokens, namespace, handle.cached_len, matchable, handle.node)
    kv.release(handle)
    return report


def test_a_prompt_never_seen_is_named_so() -> None:
    kv = KVManager(num_pages=64, page_size=PAGE)
    misses = MissTracker(kv)
    report = admit(kv, misses, list(range(1, 19)))
    assert (report.reason, report.cached_tokens, report.missed_tokens) == ("never_seen", 0, 16)
    assert report.boundary_tokens == 2 and report.prompt_tokens == 18
    assert report.head == report.tail == list(range(1, 17))
    assert list(misses.recent) == [report]


def test_a_cached_prompt_misses_only_its_page_boundary() -> None:
    kv = KVManager(num_pages=64, page_size=PAGE)
    misses = MissTracker(kv)
    prompt = list(range(1, 19))
    cached(kv, prompt)
    report = admit(kv, misses, prompt)
    assert (report.reason, report.cached_tokens, report.missed_tokens) == ("page_boundary", 16, 0)
    assert report.boundary_tokens == 2 and report.tail == [17, 18]


def test_a_prefix_held_by_another_namespace_is_named() -> None:
    kv = KVManager(num_pages=64, page_size=PAGE)
    misses = MissTracker(kv)
    prompt = list(range(1, 19))
    cached(kv, prompt, namespace="acme")
    report = admit(kv, misses, prompt, namespace="globex")
    assert (report.reason, report.cached_tokens) == ("other_namespace", 0)


def test_an_evicted_prefix_is_named_until_it_is_cached_again() -> None:
    kv = KVManager(num_pages=8, page_size=PAGE)
    misses = MissTracker(kv)
    prompt = list(range(1, 19))
    cached(kv, prompt)  # 4 pages
    cached(kv, [99] * 32)  # 8 pages: everything before is evicted
    assert kv.stats().evicted > 0
    report = admit(kv, misses, prompt)
    assert report.reason == "evicted" and report.cached_tokens == 0
    cached(kv, prompt)  # back in the pool
    assert admit(kv, misses, prompt).reason == "page_boundary"
    longer = prompt[:16] + [500, 501, 502, 503, 504, 505]
    assert admit(kv, misses, longer).reason == "never_seen"  # its 5th page never was cached


def test_the_ring_keeps_the_last_requests_only() -> None:
    kv = KVManager(num_pages=64, page_size=PAGE)
    misses = MissTracker(kv, keep=3)
    for i in range(5):
        admit(kv, misses, [i + 1] * 9)
    assert [r.head[0] for r in misses.recent] == [3, 4, 5]
