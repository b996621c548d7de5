"""The routing policies' choices: longest cached prefix, where its pages are (device before
host memory before disk before none), the balance threshold, namespaces, requests in flight,
and the text-prefix and load-only baselines."""

from __future__ import annotations

import pytest

from cluster import (
    CacheAware,
    KVIndex,
    KVSnapshot,
    LeastLoaded,
    PageTier,
    RoundRobin,
    RouteRequest,
    TextPrefixAffinity,
    TierCost,
)
from radix import page_hashes

PAGE = 4
PROMPT = list(range(1, 18))  # 4 whole reusable pages (the last token is never reused)


def index_with(**held: list[int]) -> KVIndex:
    index = KVIndex()
    for name, hashes in held.items():
        index.resync(KVSnapshot(name, 1, 0, hashes))
    return index


def test_the_replica_holding_the_longest_prefix_wins() -> None:
    chain = page_hashes(PROMPT, PAGE)
    policy = CacheAware(index_with(a=chain[:1], b=chain[:3], c=[]), PAGE, pending_ttl_s=0)
    assert policy.choose(RouteRequest(PROMPT), {"a": 0, "b": 2, "c": 0}) == "b"


def test_equal_prefixes_go_to_the_less_loaded() -> None:
    chain = page_hashes(PROMPT, PAGE)
    policy = CacheAware(index_with(a=chain[:2], b=chain[:2]), PAGE, pending_ttl_s=0)
    assert policy.choose(RouteRequest(PROMPT), {"a": 3, "b": 1}) == "b"


def test_an_overloaded_best_match_yields_to_the_least_loaded() -> None:
    chain = page_hashes(PROMPT, PAGE)
    policy = CacheAware(index_with(a=chain, b=[]), PAGE, balance_threshold=4, pending_ttl_s=0)
    assert policy.choose(RouteRequest(PROMPT), {"a": 4, "b": 0}) == "a"  # at the threshold
    assert policy.choose(RouteRequest(PROMPT), {"a": 5, "b": 0}) == "b"  # past it
    assert policy.balanced == 1


def test_a_namespace_never_matches_another_namespaces_pages() -> None:
    index = index_with(a=page_hashes(PROMPT, PAGE, namespace="tenant-a"), b=[])
    for namespace, where in (("tenant-a", "a"), ("tenant-b", "b"), (None, "b")):
        policy = CacheAware(index, PAGE, pending_ttl_s=0)
        assert policy.choose(RouteRequest(PROMPT, namespace), {"a": 2, "b": 0}) == where


def test_requests_in_flight_hold_their_prefix_until_events_arrive_or_they_expire() -> None:
    now = [0.0]
    policy = CacheAware(index_with(a=[], b=[]), PAGE, pending_ttl_s=1.0, clock=lambda: now[0])
    first = policy.choose(RouteRequest(PROMPT), {"a": 0, "b": 0})
    other = "b" if first == "a" else "a"
    # The same new prefix again before any event: it follows the first, though busier.
    assert policy.choose(RouteRequest(PROMPT + [99]), {first: 1, other: 0}) == first
    now[0] = 2.0  # expired, and no event ever confirmed it
    assert policy.choose(RouteRequest(PROMPT), {first: 1, other: 0}) == other


def test_a_prompt_shorter_than_a_page_goes_to_the_least_loaded() -> None:
    policy = CacheAware(index_with(a=[], b=[]), PAGE)
    assert policy.choose(RouteRequest([1, 2]), {"a": 1, "b": 0}) == "b"


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="balance_threshold"):
        CacheAware(KVIndex(), PAGE, balance_threshold=-1)


def test_text_prefix_affinity_follows_what_it_sent_and_fills_the_smallest_tree() -> None:
    policy = TextPrefixAffinity()
    loads = {"a": 0, "b": 0}
    first = policy.choose(RouteRequest(PROMPT), loads)
    assert policy.choose(RouteRequest(PROMPT[:12] + [50, 51]), loads) == first
    other = policy.choose(RouteRequest([70, 71, 72, 73]), loads)  # no match: smaller tree
    assert other != first
    # Another tenant's copy of the first prompt matches nothing: the smaller tree again.
    assert policy.choose(RouteRequest(PROMPT, "tenant"), loads) == other


def test_text_prefix_trees_stay_within_their_budget() -> None:
    policy = TextPrefixAffinity(max_tokens_per_replica=40)
    for i in range(30):
        policy.choose(RouteRequest([i * 100 + j for j in range(10)]), {"a": 0})
        assert policy.tree_tokens("a") <= 40


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobin()
    assert [rr.choose(RouteRequest(PROMPT), {"b": 0, "a": 9}) for _ in range(3)] == ["a", "b", "a"]
    assert LeastLoaded().choose(RouteRequest(PROMPT), {"a": 2, "b": 1, "c": 3}) == "b"


def test_a_hot_prefix_is_copied_to_more_replicas_and_a_cold_one_never() -> None:
    chain = page_hashes(PROMPT, PAGE)
    names = ["a", "b", "c", "d"]
    now = [0.0]
    index = index_with(a=chain, b=[], c=[], d=[])
    policy = CacheAware(index, PAGE, pending_ttl_s=0, clock=lambda: now[0])
    loads = dict.fromkeys(names, 0)
    cold = [[100 + 10 * i + j for j in range(17)] for i in range(12)]
    chosen = []
    for i in range(12):  # the hot prompt half the time, the rest each seen once
        chosen.append(policy.choose(RouteRequest(PROMPT + [i]), loads))
        policy.choose(RouteRequest(cold[i]), loads)
        now[0] += 0.1
    assert policy.copied > 0 and len(set(chosen)) > 1  # spread over more than its home
    assert chosen[0] == "a"  # before it is known to be hot, it stays where it is cached
    # A prompt only ever seen where it is cached stays there, however busy that replica was.
    lone = [7] * 17
    index.resync(KVSnapshot("a", 1, 0, chain + page_hashes(lone, PAGE)))
    assert policy.choose(RouteRequest(lone), loads) == "a"


def test_a_prefix_on_the_device_beats_it_in_host_memory_beats_disk_beats_none() -> None:
    chain = page_hashes(PROMPT, PAGE)
    places = {
        "device": KVSnapshot("device", 1, 0, chain),
        "host": KVSnapshot("host", 1, 0, chain, host=chain[2:]),
        "disk": KVSnapshot("disk", 1, 0, chain, disk=chain[2:]),
        "none": KVSnapshot("none", 1, 0, []),
    }
    order = ["device", "host", "disk", "none"]
    for i, expected in enumerate(order):
        index = KVIndex()
        for name in order[i:]:
            index.resync(places[name])
        policy = CacheAware(index, PAGE, pending_ttl_s=0)
        # the better place wins even where it is busier (within the balance threshold)
        loads = {name: 4 - j for j, name in enumerate(order[i:])}
        assert policy.choose(RouteRequest(PROMPT), loads) == expected


def test_a_deeper_prefix_below_the_pool_outweighs_a_shallower_one_in_it() -> None:
    chain = page_hashes(PROMPT, PAGE)
    index = KVIndex()
    index.resync(KVSnapshot("pool", 1, 0, chain[:1]))
    index.resync(KVSnapshot("below", 1, 0, chain, host=chain[1:]))
    policy = CacheAware(index, PAGE, pending_ttl_s=0)
    assert policy.choose(RouteRequest(PROMPT), {"pool": 0, "below": 0}) == "below"
    assert policy.prefix_runs(chain, ["pool", "below"]) == {
        "pool": [PageTier.DEVICE],
        "below": [PageTier.DEVICE] + [PageTier.HOST] * 3,
    }


def test_a_router_blind_to_the_tiers_counts_pages_below_the_pool_as_missing() -> None:
    chain = page_hashes(PROMPT, PAGE)
    index = KVIndex()
    index.resync(KVSnapshot("pool", 1, 0, chain[:1]))
    index.resync(KVSnapshot("below", 1, 0, chain, host=chain[1:]))
    blind = CacheAware(index, PAGE, pending_ttl_s=0, tier_cost=None)
    assert blind.prefix_pages(chain, ["pool", "below"]) == {"pool": 1, "below": 1}
    assert blind.choose(RouteRequest(PROMPT), {"pool": 0, "below": 1}) == "pool"


def test_a_tier_cost_is_a_share_of_recomputing_and_disk_is_no_cheaper_than_host() -> None:
    cost = TierCost(host=0.1, disk=0.5)
    run = [PageTier.DEVICE, PageTier.HOST, PageTier.DISK]
    assert cost.saved(run) == pytest.approx(1 + 0.9 + 0.5)
    for bad in ({"host": 1.0}, {"host": -0.1}, {"host": 0.3, "disk": 0.2}):
        with pytest.raises(ValueError):
            TierCost(**bad)
