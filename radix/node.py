"""Tree nodes and match results of the radix cache."""

from __future__ import annotations

from dataclasses import dataclass

from radix.hashing import chain_hashes, namespace_seed
from radix.tokens import decode_tokens


class Node:
    """A run of whole pages: ``key`` holds their tokens as canonical bytes, ``pages`` their ids.

    Mutable only through its RadixCache. A node that is not locked may be split, shrunk or
    removed by the cache's next insert, match or evict.
    """

    __slots__ = (
        "parent",
        "children",
        "key",
        "pages",
        "namespace",
        "lock_ref",
        "own_locks",
        "last_access",
        "in_lru",
        "_hashes",
    )

    def __init__(
        self,
        parent: Node | None,
        key: bytes,
        pages: list[int],
        namespace: str | None,
        last_access: int = 0,
    ) -> None:
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.key = key
        self.pages = pages
        self.namespace = namespace
        self.lock_ref = 0  # outstanding locks on this node or any descendant
        self.own_locks = 0  # outstanding locks taken on this node itself
        self.last_access = last_access  # logical clock; also the node's key in the LRU index
        self.in_lru = False
        self._hashes: list[int] | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.key

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def tokens(self) -> list[int]:
        """This node's own token ids (not its ancestors')."""
        return decode_tokens(self.key)

    @property
    def page_hashes(self) -> list[int]:
        """The xxh3_64 chain hashes of this node's pages (computed on first use, then kept)."""
        if self._hashes is None:
            self._fill_hashes()
        assert self._hashes is not None
        return list(self._hashes)

    @property
    def hash(self) -> int:
        """Content address of the prefix ending at this node: its last page's chain hash.

        The root's is its namespace's seed.
        """
        if not self.pages:
            return namespace_seed(self.namespace)
        if self._hashes is None:
            self._fill_hashes()
        assert self._hashes is not None
        return self._hashes[-1]

    def _fill_hashes(self) -> None:
        # Walk up to the nearest node whose chain is known, then fill downwards (no recursion).
        pending: list[Node] = []
        node: Node | None = self
        while node is not None and node.pages and node._hashes is None:
            pending.append(node)
            node = node.parent
        seed = namespace_seed(self.namespace) if node is None or not node.pages else node.hash
        for item in reversed(pending):
            page_bytes = len(item.key) // len(item.pages)
            item._hashes = chain_hashes(item.key, page_bytes, seed)
            seed = item._hashes[-1]

    def __repr__(self) -> str:
        return (
            f"Node(pages={len(self.pages)}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, namespace={self.namespace!r})"
        )


@dataclass(slots=True)
class PrefixMatch:
    """The cached part of a token sequence: ``length`` tokens held in ``pages``.

    ``node`` ends exactly at ``length`` (the root when nothing matched); lock it to keep the
    pages from being evicted.
    """

    length: int
    pages: list[int]
    node: Node


@dataclass(slots=True)
class PrefixInsert:
    """What ``RadixCache.insert_prefix`` did: ``cached`` leading tokens were in the tree
    already (the caller's pages for them are duplicates), and the whole inserted prefix now
    lives at ``match`` (its node ends exactly at the inserted length)."""

    cached: int
    match: PrefixMatch
