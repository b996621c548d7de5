"""A full consistency check of a RadixCache, for tests and debugging (walks the whole tree)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radix.hashing import chain_hashes, namespace_seed

if TYPE_CHECKING:
    from radix.cache import RadixCache
    from radix.node import Node


def check_cache(cache: RadixCache) -> None:
    """Raise AssertionError with a message naming the first broken invariant."""
    page_bytes = cache._page_bytes
    seen_pages: set[int] = set()
    evictable = protected = 0
    evictable_leaves: dict[int, Node] = {}
    clock_values: set[int] = set()
    num_nodes = 0
    for namespace, root in cache._roots.items():
        assert root.parent is None and not root.key and not root.pages, "root holds tokens"
        assert root.namespace == namespace, "root filed under the wrong namespace"
        assert not root.in_lru, "a root is in the LRU index"
        stack: list[tuple[Node, int]] = [(root, namespace_seed(namespace))]
        while stack:
            node, seed = stack.pop()
            locks_below = 0
            for first, child in node.children.items():
                assert child.parent is node, "child's parent pointer is wrong"
                assert child.namespace == namespace, "a node shares two namespaces"
                assert child.pages, "a non-root node holds no pages"
                assert len(child.key) == len(child.pages) * page_bytes, (
                    f"node key holds {len(child.key)} bytes for {len(child.pages)} pages"
                )
                assert child.key[:page_bytes] == first, "child filed under the wrong first page"
                locks_below += child.lock_ref
                hashes = chain_hashes(child.key, page_bytes, seed)
                if child._hashes is not None:
                    assert child._hashes == hashes, "cached page hashes are stale"
                stack.append((child, hashes[-1]))
            assert node.own_locks >= 0, "negative own lock count"
            assert node.lock_ref == node.own_locks + locks_below, (
                f"lock_ref {node.lock_ref} != own locks {node.own_locks} + children's {locks_below}"
            )
            if node is root:
                continue
            num_nodes += 1
            for page in node.pages:
                assert page not in seen_pages, f"page {page} appears in two nodes"
                seen_pages.add(page)
            if node.lock_ref == 0:
                evictable += len(node.pages)
            else:
                protected += len(node.pages)
            assert node.last_access <= cache._clock, "a node's time is ahead of the clock"
            assert node.last_access not in clock_values, "two nodes share one clock value"
            clock_values.add(node.last_access)
            is_evictable_leaf = not node.children and node.lock_ref == 0
            assert node.in_lru == is_evictable_leaf, (
                f"node in LRU index = {node.in_lru}, but evictable leaf = {is_evictable_leaf}"
            )
            if is_evictable_leaf:
                evictable_leaves[node.last_access] = node
    assert evictable == cache._evictable, (
        f"evictable_pages {cache._evictable} != {evictable} counted in the tree"
    )
    assert protected == cache._protected, (
        f"protected_pages {cache._protected} != {protected} counted in the tree"
    )
    assert num_nodes == cache._num_nodes, (
        f"num_nodes {cache._num_nodes} != {num_nodes} nodes in the tree"
    )
    assert len(cache._lru) == len(evictable_leaves), (
        f"LRU index holds {len(cache._lru)} leaves, the tree has {len(evictable_leaves)}"
    )
    for key, node in cache._lru.items():
        assert evictable_leaves.get(key) is node, f"LRU index entry {key} is stale"
