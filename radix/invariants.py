"""A full walk of a radix tree's nodes, checking each against its neighbours (for tests and
debugging: it visits every node).

It sees only nodes, never the cache that owns them: it checks what each node must agree with
(its parent, its children, its pages, its hashes, the clock) and returns what it counted, which
``RadixCache.check_invariants`` compares with the counters and the LRU index it keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from radix.hashing import chain_hashes, namespace_seed
from radix.node import Node


@dataclass(slots=True)
class TreeCount:
    """What the nodes hold: pages no lock protects, pages on a locked path, non-root nodes,
    and the evictable leaves (unlocked, childless) by their ``last_access``."""

    evictable_pages: int = 0
    protected_pages: int = 0
    num_nodes: int = 0
    evictable_leaves: dict[int, Node] = field(default_factory=dict)


def check_tree(roots: Mapping[str | None, Node], page_bytes: int, clock: int) -> TreeCount:
    """Walk every namespace's tree under ``roots`` (pages of ``page_bytes`` token bytes, no
    node newer than ``clock``); raise AssertionError naming the first broken invariant."""
    count = TreeCount()
    seen_pages: set[int] = set()
    clock_values: set[int] = set()
    for namespace, root in roots.items():
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
            count.num_nodes += 1
            for page in node.pages:
                assert page not in seen_pages, f"page {page} appears in two nodes"
                seen_pages.add(page)
            if node.lock_ref == 0:
                count.evictable_pages += len(node.pages)
            else:
                count.protected_pages += len(node.pages)
            assert node.last_access <= clock, "a node's time is ahead of the clock"
            assert node.last_access not in clock_values, "two nodes share one clock value"
            clock_values.add(node.last_access)
            is_evictable_leaf = not node.children and node.lock_ref == 0
            assert node.in_lru == is_evictable_leaf, (
                f"node in LRU index = {node.in_lru}, but evictable leaf = {is_evictable_leaf}"
            )
            if is_evictable_leaf:
                count.evictable_leaves[node.last_access] = node
    return count
