"""Behaviour of RadixCache: matching, splitting, insert's return value, locks, eviction."""

from __future__ import annotations

import numpy as np
import pytest

from radix import Node, PageAllocator, RadixCache


def test_match_on_empty_cache_returns_root_and_nothing() -> None:
    cache = RadixCache(page_size=2)
    match = cache.match_prefix([1, 2, 3, 4])
    assert (match.length, match.pages) == (0, [])
    assert match.node.is_root
    cache.check_invariants()


def test_insert_then_match_returns_exactly_the_inserted_pages_for_every_aligned_prefix() -> None:
    cache = RadixCache(page_size=2)
    tokens = [5, 6, 7, 8, 9, 10, 11]
    assert cache.insert(tokens, [100, 101, 102]) == 0
    for n in range(len(tokens) + 1):
        match = cache.match_prefix(tokens[:n])
        aligned = n - n % 2
        assert match.length == aligned
        assert match.pages == [100, 101, 102][: aligned // 2]
    cache.check_invariants()


def test_partial_match_splits_the_node_at_a_page_boundary() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    match = cache.match_prefix([1, 2, 3, 9, 5, 6])
    # Only the first whole page agrees; the mismatch inside page 2 does not count.
    assert (match.length, match.pages) == (2, [10])
    assert match.node.tokens == [1, 2] and match.node.pages == [10]
    (lower,) = match.node.children.values()
    assert lower.tokens == [3, 4, 5, 6] and lower.pages == [11, 12]
    assert lower.parent is match.node
    cache.check_invariants()
    # The full path still matches through the split.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == [10, 11, 12]


def test_match_shorter_than_a_node_splits_it_so_node_ends_at_length() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    match = cache.match_prefix([1, 2])
    assert match.length == 2 and match.node.pages == [0, 1]
    cache.check_invariants()


def test_match_stops_at_the_last_whole_page_that_agrees() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    cache.insert([7, 7], [3])
    assert cache.match_prefix([1, 2, 3, 4, 9, 9]).length == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 8]).length == 6
    assert cache.match_prefix([1, 2, 3, 4], namespace="other").length == 0
    cache.check_invariants()


def test_unaligned_tail_is_ignored_by_match_and_insert() -> None:
    cache = RadixCache(page_size=4)
    assert cache.insert([1, 2, 3, 4, 5, 6], [7]) == 0
    assert cache.cached_pages == 1
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).length == 4
    assert cache.match_prefix([1, 2, 3]).length == 0


def test_duplicate_insert_returns_the_cached_length() -> None:
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4], [0, 1]) == 0
    assert cache.insert([1, 2, 3, 4], [5, 6]) == 4
    # The tree keeps its own pages; the caller's 5 and 6 were duplicates.
    assert cache.match_prefix([1, 2, 3, 4]).pages == [0, 1]
    assert cache.insert([1, 2, 3, 4, 7, 8], [5, 6, 9]) == 4
    assert cache.match_prefix([1, 2, 3, 4, 7, 8]).pages == [0, 1, 9]
    assert cache.insert([1, 2, 9, 9], [10, 11]) == 2
    assert cache.match_prefix([1, 2, 9, 9]).pages == [0, 11]
    assert cache.cached_pages == 4
    cache.check_invariants()


def test_numpy_and_list_tokens_are_interchangeable() -> None:
    cache = RadixCache(page_size=2)
    cache.insert(np.array([3, 4, 5, 6], dtype=np.int64), np.array([1, 2]))
    assert cache.match_prefix([3, 4, 5, 6]).pages == [1, 2]
    assert cache.match_prefix(np.array([3, 4, 5, 6], dtype=np.int32)).length == 4
    assert cache.match_prefix(np.array([3, 4], dtype=np.uint16)).length == 2
    assert all(type(p) is int for p in cache.match_prefix([3, 4, 5, 6]).pages)


def test_eviction_order_is_lru_among_unlocked_leaves() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 1], [0, 1])
    cache.insert([2, 2], [2, 3])
    cache.insert([3, 3], [4, 5])
    cache.match_prefix([1, 1])  # now [2, 2] is the oldest, then [3, 3]
    assert cache.evict(2) == [2, 3]
    assert cache.evict(2) == [4, 5]
    assert cache.evict(2) == [0, 1]
    assert cache.cached_pages == 0
    cache.check_invariants()


def test_evict_frees_only_the_tail_pages_of_a_leaf_bigger_than_needed() -> None:
    cache = RadixCache(page_size=2)
    cache.insert(list(range(10)), [0, 1, 2, 3, 4])
    assert cache.evict(2) == [3, 4]
    assert cache.match_prefix(list(range(10))).pages == [0, 1, 2]
    assert cache.cached_pages == 3
    cache.check_invariants()


def test_evict_removes_children_before_their_parent() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [9, 9, 3])
    cache.match_prefix([1, 2, 4])
    freed = cache.evict(2)
    # Oldest leaf [3] goes first, then the next oldest leaf is [4]; the shared [1, 2] stays.
    assert freed == [2, 3]
    assert cache.match_prefix([1, 2]).pages == [0, 1]
    cache.check_invariants()


def test_a_locked_path_survives_evict_everything() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    cache.insert([1, 2, 7, 8], [9, 3])
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.node)
    assert cache.protected_pages == 2 and cache.evictable_pages == 2
    freed = cache.evict(1000)
    assert sorted(freed) == [2, 3]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == [0, 1]
    assert cache.evictable_pages == 0 and cache.protected_pages == 2
    cache.check_invariants()
    cache.unlock(match.node)
    assert cache.evictable_pages == 2 and cache.protected_pages == 0
    assert sorted(cache.evict(1000)) == [0, 1]
    cache.check_invariants()


def test_locks_nest_and_shared_pages_are_counted_once() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [7, 8, 3])
    a = cache.match_prefix([1, 2, 3]).node
    b = cache.match_prefix([1, 2, 4]).node
    cache.lock(a)
    cache.lock(b)
    cache.lock(b)
    assert (cache.protected_pages, cache.evictable_pages, cache.cached_pages) == (4, 0, 4)
    cache.unlock(b)
    assert cache.protected_pages == 4
    cache.unlock(b)
    assert (cache.protected_pages, cache.evictable_pages) == (3, 1)
    cache.unlock(a)
    assert (cache.protected_pages, cache.evictable_pages) == (0, 4)
    cache.check_invariants()


def test_unlock_of_an_unlocked_node_raises() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [0, 1])
    node = cache.match_prefix([1, 2]).node
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)


def test_unlocking_a_child_does_not_release_a_lock_held_on_its_ancestor() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    parent = cache.match_prefix([1, 2]).node
    child = cache.match_prefix([1, 2, 3]).node
    cache.lock(parent)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(child)
    cache.check_invariants()


def test_lock_of_an_evicted_node_raises() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [0, 1])
    node = cache.match_prefix([1, 2]).node
    cache.evict(2)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(node)
    with pytest.raises(ValueError, match="not in this cache"):
        RadixCache().lock(Node(None, b"\x01\x00\x00\x00", [0], None))


def test_a_locked_node_keeps_its_meaning_across_a_split() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    cache.match_prefix([1, 2])  # splits the locked node above it
    cache.check_invariants()
    assert cache.protected_pages == 4
    cache.unlock(node)
    assert cache.evictable_pages == 4
    cache.check_invariants()


def test_namespaces_isolate_nodes_pages_and_hits() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [0, 1], namespace="alice")
    assert cache.match_prefix([1, 2, 3, 4]).length == 0
    assert cache.match_prefix([1, 2, 3, 4], namespace="bob").length == 0
    assert cache.insert([1, 2, 3, 4], [2, 3], namespace="bob") == 0
    assert cache.insert([1, 2, 3, 4], [4, 5]) == 0
    assert cache.match_prefix([1, 2, 3, 4], namespace="alice").pages == [0, 1]
    assert cache.match_prefix([1, 2, 3, 4], namespace="bob").pages == [2, 3]
    assert cache.match_prefix([1, 2, 3, 4]).pages == [4, 5]
    assert cache.match_prefix([1, 2], namespace="").length == 0
    assert cache.cached_pages == 6
    cache.check_invariants()


def test_eviction_spans_namespaces_in_lru_order() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1], [0], namespace="a")
    cache.insert([1], [1], namespace="b")
    cache.match_prefix([1], namespace="a")
    assert cache.evict(1) == [1]
    assert cache.match_prefix([1], namespace="a").pages == [0]


def test_idle_allocator_and_tree_account_for_every_page() -> None:
    allocator = PageAllocator(8)
    cache = RadixCache(page_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    pages = allocator.alloc(3)
    assert pages is not None
    cache.insert(tokens, pages)
    # A second request with the same prompt computes it again and frees its duplicates.
    dup = allocator.alloc(3)
    assert dup is not None
    cached = cache.insert(tokens, dup)
    allocator.free(dup[: cached // 2])
    assert allocator.num_free + cache.cached_pages == allocator.num_pages
    allocator.free(cache.evict(100))
    assert allocator.num_free == allocator.num_pages


@pytest.mark.parametrize("page_size", [0, -1, 1.5, True])
def test_bad_page_size_raises(page_size: object) -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=page_size)  # type: ignore[arg-type]


def test_pages_tokens_length_mismatch_raises_and_changes_nothing() -> None:
    cache = RadixCache(page_size=2)
    with pytest.raises(ValueError, match="pages: expected .* 2 page ids, got 3"):
        cache.insert([1, 2, 3, 4, 5], [0, 1, 2])
    with pytest.raises(ValueError, match="pages"):
        cache.insert([1, 2, 3, 4], [0])
    assert cache.cached_pages == 0
    cache.check_invariants()


@pytest.mark.parametrize(
    "tokens",
    [[1, 2.0], [1, "a"], [1, None], np.array([1.0, 2.0]), np.array([[1, 2]]), "ab", [2**40]],
)
def test_non_int_tokens_raise(tokens: object) -> None:
    cache = RadixCache(page_size=1)
    with pytest.raises(ValueError, match="tokens"):
        cache.match_prefix(tokens)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens"):
        cache.insert(tokens, [0, 1])  # type: ignore[arg-type]


def test_bad_namespace_and_evict_arguments_raise() -> None:
    cache = RadixCache(page_size=1)
    with pytest.raises(ValueError, match="namespace"):
        cache.match_prefix([1], namespace=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_pages"):
        cache.evict(-1)


def test_evict_beyond_what_is_evictable_returns_what_it_could() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    assert sorted(cache.evict(10)) == [0, 1, 2]
    assert cache.evict(5) == []
    assert cache.evict(0) == []
    cache.check_invariants()


def test_check_invariants_reports_a_page_held_twice() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [0, 1])
    cache.insert([3, 4], [1, 2])  # a caller bug: page 1 handed to the tree twice
    with pytest.raises(AssertionError, match="page 1 appears in two nodes"):
        cache.check_invariants()


def test_check_invariants_reports_a_wrong_lock_count() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [0, 1])
    node = cache.match_prefix([1, 2]).node
    node.lock_ref += 1  # simulate a lock that skipped the ancestors
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_invariants()
