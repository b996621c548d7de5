"""Page hashes: the tree's chain equals radix.page_hashes, and namespaces seed it apart."""

from __future__ import annotations

import numpy as np
import pytest

from radix import RadixCache, page_hashes


def _path_hashes(cache: RadixCache, tokens: list[int], namespace: str | None = None) -> list[int]:
    node = cache.match_prefix(tokens, namespace).node
    chain: list[list[int]] = []
    while not node.is_root:
        chain.append(node.page_hashes)
        assert node.parent is not None
        node = node.parent
    return [h for hashes in reversed(chain) for h in hashes]


def test_page_hashes_match_the_trees_across_splits_and_shrinks() -> None:
    cache = RadixCache(page_size=2)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 9, 9]
    cache.insert(a, [0, 1, 2, 3])
    full = page_hashes(a, 2)
    assert _path_hashes(cache, a) == full
    cache.insert(b, [9, 9, 4])  # splits the node whose hashes are already known
    assert _path_hashes(cache, b) == page_hashes(b, 2)
    assert _path_hashes(cache, a) == full
    cache.match_prefix(b)
    cache.evict(1)  # shrinks the [5..8] leaf to one page
    assert _path_hashes(cache, a[:6]) == full[:3]
    assert cache.match_prefix(a).node.hash == full[2]
    cache.check_invariants()


def test_chain_depends_on_the_whole_prefix_not_just_the_page() -> None:
    one = page_hashes([1, 2, 3, 4], 2)
    other = page_hashes([9, 9, 3, 4], 2)
    assert one[1] != other[1]
    assert page_hashes([1, 2, 3, 4, 5], 2) == one  # the unaligned tail is ignored


def test_namespaces_seed_different_chains() -> None:
    tokens = [1, 2, 3, 4]
    chains = {tuple(page_hashes(tokens, 2, ns)) for ns in (None, "", "a", "b")}
    assert len(chains) == 4
    cache = RadixCache(page_size=2)
    cache.insert(tokens, [0, 1], namespace="a")
    assert _path_hashes(cache, tokens, "a") == page_hashes(tokens, 2, "a")


def test_list_and_numpy_tokens_hash_the_same() -> None:
    tokens = [7, 70000, 3, 2**31 - 1]
    assert page_hashes(tokens, 1) == page_hashes(np.array(tokens, dtype=np.int64), 1)


def test_root_hash_is_the_namespace_seed_and_page_size_is_checked() -> None:
    cache = RadixCache(page_size=1)
    assert cache.root("x").hash != cache.root(None).hash
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 0)
