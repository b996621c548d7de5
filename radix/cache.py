"""RadixCache: a page-aligned radix tree from token prefixes to KV page ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sortedcontainers import SortedDict

from radix.hashing import namespace_seed
from radix.invariants import check_tree
from radix.node import Node, PrefixInsert, PrefixMatch
from radix.tiers.record import EvictedPage
from radix.tokens import TOKEN_BYTES, TOKEN_DTYPE, decode_tokens, encode_tokens


class RadixCache:
    """Maps page-aligned token prefixes to page ids, per namespace, with LRU leaf eviction.

    Children are found by a dict lookup on their first page's bytes and a node's tokens are
    compared with one ``bytes.startswith``; numpy only locates a mismatch inside a node. The
    evictable leaves sit in a SortedDict keyed by a logical clock, updated on every lock,
    unlock, insert, match and evict, so ``evict`` never walks the tree.
    """

    def __init__(self, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size: must be an int >= 1, got {page_size!r}")
        self._page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._roots: dict[str | None, Node] = {}
        self._lru: SortedDict = SortedDict()  # last_access -> evictable leaf
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0  # non-root nodes
        self._splits = 0
        self._evicted_pages = 0
        self._eviction_steps = 0  # leaves removed or shrunk by evict

    # ----------------------------------------------------------------- properties

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def evictable_pages(self) -> int:
        """Cached pages no lock protects (each page counted once)."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Cached pages on a locked path."""
        return self._protected

    @property
    def cached_pages(self) -> int:
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        """Non-root nodes in the tree (all namespaces)."""
        return self._num_nodes

    @property
    def stats(self) -> dict[str, int]:
        """Monotone counters: splits, evicted pages, eviction steps (leaves removed or shrunk)."""
        return {
            "splits": self._splits,
            "evicted_pages": self._evicted_pages,
            "eviction_steps": self._eviction_steps,
        }

    @property
    def namespaces(self) -> list[str | None]:
        return list(self._roots)

    def root(self, namespace: str | None = None) -> Node:
        """The root of a namespace's subtree (created on first use)."""
        root = self._roots.get(namespace)
        if root is None:
            namespace_seed(namespace)  # validates the namespace's type
            root = self._roots[namespace] = Node(None, b"", [], namespace)
        return root

    # ----------------------------------------------------------------- match / insert

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, namespace: str | None = None
    ) -> PrefixMatch:
        """The longest cached page-aligned prefix of ``tokens``.

        Splits a node on a partial match so the returned node ends exactly at ``length``, and
        refreshes the LRU time of every node on the path.
        """
        buf = encode_tokens(tokens)
        root = self._roots.get(namespace)
        if root is None:
            root = self.root(namespace)
        node, pos, pages, path = self._descend(root, buf, len(buf) - len(buf) % self._page_bytes)
        if path:
            self._touch(path)
        return PrefixMatch(pos // TOKEN_BYTES, pages, node)

    def insert(
        self,
        tokens: Sequence[int] | np.ndarray,
        pages: Sequence[int] | np.ndarray,
        namespace: str | None = None,
    ) -> int:
        """Cache the whole pages of ``tokens``, held in ``pages`` (one id per whole page).

        Returns how many leading tokens were already cached. The caller's pages for tokens
        before that are duplicates (the tree keeps its own), the ones after are now owned by
        the tree. Page ids are trusted (they come from a PageAllocator): only their count is
        checked here; ``check_invariants`` finds a page held twice.
        """
        return self._insert(tokens, pages, namespace, collect_pages=False)[0]

    def insert_prefix(
        self,
        tokens: Sequence[int] | np.ndarray,
        pages: Sequence[int] | np.ndarray,
        namespace: str | None = None,
    ) -> PrefixInsert:
        """``insert``, also returning where the inserted prefix now lives (node and pages),
        so a caller that keeps a lock on it needs no second walk."""
        cached, node, tree_pages = self._insert(tokens, pages, namespace, collect_pages=True)
        length = len(tree_pages) * self._page_size
        return PrefixInsert(cached, PrefixMatch(length, tree_pages, node))

    def _insert(
        self,
        tokens: Sequence[int] | np.ndarray,
        pages: Sequence[int] | np.ndarray,
        namespace: str | None,
        collect_pages: bool,
    ) -> tuple[int, Node, list[int]]:
        buf = encode_tokens(tokens)
        page_bytes = self._page_bytes
        num_pages = len(buf) // page_bytes
        if len(pages) != num_pages:
            raise ValueError(
                f"pages: expected len(tokens) // page_size = {len(buf) // TOKEN_BYTES} // "
                f"{self._page_size} = {num_pages} page ids, got {len(pages)}"
            )
        root = self._roots.get(namespace)
        if root is None:
            root = self.root(namespace)
        end = num_pages * page_bytes
        node, pos, tree_pages, path = self._descend(root, buf, end, collect_pages)
        if pos < end:
            first = pos // page_bytes
            if isinstance(pages, list):
                new_pages = pages[first:]  # a slice is already a fresh list
            elif isinstance(pages, np.ndarray):
                new_pages = pages[first:].tolist()
            else:
                new_pages = list(pages[first:])
            if node.in_lru:  # it gains a child: no longer a leaf
                del self._lru[node.last_access]
                node.in_lru = False
            leaf = Node(node, buf[pos:end], new_pages, namespace)
            node.children[buf[pos : pos + page_bytes]] = leaf
            self._num_nodes += 1
            self._evictable += len(new_pages)
            path.append(leaf)
            node = leaf
            if collect_pages:
                tree_pages.extend(new_pages)
        if path:
            self._touch(path)
        return pos // TOKEN_BYTES, node, tree_pages

    def _descend(
        self, root: Node, buf: bytes, end: int, collect_pages: bool = True
    ) -> tuple[Node, int, list[int], list[Node]]:
        """Follow ``buf[:end]`` down from ``root``; split the last node on a partial match.

        Returns the deepest matched node, the matched length in bytes, the matched pages
        (when asked) and the matched nodes below the root.
        """
        page_bytes = self._page_bytes
        node = root
        pos = 0
        pages: list[int] = []
        path: list[Node] = []
        while pos < end:
            child = node.children.get(buf[pos : pos + page_bytes])
            if child is None:
                break
            key = child.key
            if buf.startswith(key, pos):
                # Whole-node match; key is page-aligned, so pos stays <= end.
                if collect_pages:
                    pages.extend(child.pages)
                pos += len(key)
                node = child
                path.append(child)
                continue
            matched = self._common_prefix_bytes(buf, pos, end, key)
            child = self._split(child, matched // page_bytes)
            if collect_pages:
                pages.extend(child.pages)
            pos += len(child.key)
            node = child
            path.append(child)
            break
        return node, pos, pages, path

    def continuation(self, node: Node, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens the tree holds right after ``node``'s prefix followed by
        ``tokens`` (empty when the tree does not hold that sequence). Read-only: nothing is
        split, touched or locked, so a speculative lookup never changes what gets evicted.
        ``node`` must be live (a handle's locked node). Where the path forks, the most recently
        used branch is read."""
        if max_tokens <= 0:
            return []
        buf = encode_tokens(tokens)
        page_bytes = self._page_bytes
        pos = 0
        while True:
            if pos == len(buf):
                if not node.children:
                    return []
                node = max(node.children.values(), key=_last_access)
                return decode_tokens(node.key[: max_tokens * TOKEN_BYTES])
            rest = len(buf) - pos
            if rest >= page_bytes:
                child = node.children.get(buf[pos : pos + page_bytes])
            else:  # a part of a page: the children whose first page begins with it
                tail = buf[pos:]
                found = [c for c in node.children.values() if c.key.startswith(tail)]
                child = max(found, key=_last_access) if found else None
            if child is None:
                return []
            key = child.key
            if rest < len(key):
                if not key.startswith(buf[pos:]):
                    return []
                return decode_tokens(key[rest : rest + max_tokens * TOKEN_BYTES])
            if not buf.startswith(key, pos):
                return []
            pos += len(key)
            node = child

    @staticmethod
    def _common_prefix_bytes(buf: bytes, pos: int, end: int, key: bytes) -> int:
        count = min(len(key), end - pos) // TOKEN_BYTES
        a = np.frombuffer(buf, dtype=TOKEN_DTYPE, count=count, offset=pos)
        b = np.frombuffer(key, dtype=TOKEN_DTYPE, count=count)
        diff = np.flatnonzero(a != b)
        return (int(diff[0]) if diff.size else count) * TOKEN_BYTES

    def _split(self, node: Node, head_pages: int) -> Node:
        """Cut ``node`` after ``head_pages`` pages; returns the new upper node (the head)."""
        assert 0 < head_pages < len(node.pages), "split must leave pages on both sides"
        cut = head_pages * self._page_bytes
        parent = node.parent
        assert parent is not None
        pages = node.pages
        if 2 * head_pages <= len(pages):
            head_list = pages[:head_pages]
            del pages[:head_pages]
        else:  # copy the shorter side: the head keeps the list, the tail gets a copy
            head_list = pages
            node.pages = pages[head_pages:]
            del pages[head_pages:]
        head = Node(parent, node.key[:cut], head_list, node.namespace)
        head.lock_ref = node.lock_ref
        head.last_access = node.last_access
        if node._hashes is not None:
            head._hashes = node._hashes[:head_pages]
            node._hashes = node._hashes[head_pages:]
        parent.children[node.key[: self._page_bytes]] = head
        node.key = node.key[cut:]
        node.parent = head
        head.children[node.key[: self._page_bytes]] = node
        self._num_nodes += 1
        self._splits += 1
        return head

    def _touch(self, path: list[Node]) -> None:
        """Give every node on a path a fresh clock value, deeper nodes newer."""
        last = path[-1]
        lru = self._lru
        if last.in_lru:
            del lru[last.last_access]
        clock = self._clock
        for node in path:
            clock += 1
            node.last_access = clock
        self._clock = clock
        if last.in_lru or (not last.children and last.lock_ref == 0):
            lru[clock] = last
            last.in_lru = True

    # ----------------------------------------------------------------- locks

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (locks nest)."""
        self._check_live(node)
        node.own_locks += 1
        lru = self._lru
        moved = 0
        current: Node | None = node
        while current is not None:
            if current.lock_ref == 0:
                moved += len(current.pages)
                if current.in_lru:
                    del lru[current.last_access]
                    current.in_lru = False
            current.lock_ref += 1
            current = current.parent
        self._evictable -= moved
        self._protected += moved

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``; raises ValueError if ``node`` holds no lock."""
        self._check_live(node)
        if node.own_locks == 0:
            raise ValueError("node: unlock of a node that is not locked")
        node.own_locks -= 1
        lru = self._lru
        moved = 0
        current = node
        while True:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                moved += len(current.pages)
                if not current.children and current.parent is not None:
                    lru[current.last_access] = current
                    current.in_lru = True
            if current.parent is None:
                break
            current = current.parent
        self._evictable += moved
        self._protected -= moved
        self._forget_if_empty(current)

    def _forget_if_empty(self, node: Node) -> None:
        """Drop a tenant's root once nothing is under it and nothing holds it, so one-shot
        namespaces do not accumulate (the default namespace's root stays)."""
        if (
            node.parent is None
            and node.namespace is not None
            and not node.children
            and node.lock_ref == 0
            and self._roots.get(node.namespace) is node
        ):
            del self._roots[node.namespace]

    def _check_live(self, node: Node) -> None:
        if not isinstance(node, Node):
            raise ValueError(f"node: expected a Node, got {type(node).__name__}")
        top = node
        while top.parent is not None:
            top = top.parent
        if self._roots.get(top.namespace) is not top:
            raise ValueError("node: not in this cache (it was evicted, or is from another cache)")

    # ----------------------------------------------------------------- eviction

    def evict(self, num_pages: int, described: list[EvictedPage] | None = None) -> list[int]:
        """Free up to ``num_pages`` pages, least recently used unlocked leaves first.

        A leaf holding more pages than still needed loses only its tail pages. Returns the
        freed page ids, in no particular order (fewer than asked only when nothing else is
        evictable); the list is the caller's. ``described``, when given, receives each freed
        page with its content address and tokens (what a KV tier below needs to keep it).
        """
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages: must be an int >= 0, got {num_pages!r}")
        freed: list[int] = []
        need = num_pages
        lru = self._lru
        page_bytes = self._page_bytes
        while need > 0 and lru:
            _, leaf = lru.peekitem(0)
            self._eviction_steps += 1
            pages = leaf.pages
            size = len(pages)
            if described is not None:
                self._describe(leaf, max(0, size - need), described)
            if size <= need:
                lru.popitem(0)
                leaf.in_lru = False
                leaf.pages = []  # the leaf is discarded: its list becomes the freed piece
                piece = pages
                need -= size
                parent = leaf.parent
                del parent.children[leaf.key[:page_bytes]]
                leaf.parent = None
                self._num_nodes -= 1
                if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                    lru[parent.last_access] = parent
                    parent.in_lru = True
                self._forget_if_empty(parent)
            else:
                keep = size - need
                if keep < need:  # copy the shorter side: keep the head, hand over the list
                    leaf.pages = pages[:keep]
                    del pages[:keep]
                    piece = pages
                else:
                    piece = pages[keep:]
                    del pages[keep:]
                leaf.key = leaf.key[: keep * page_bytes]
                if leaf._hashes is not None:
                    del leaf._hashes[keep:]
                need = 0
            # Merge into the longer list so each page id is copied at most once.
            if not freed:
                freed = piece
            elif len(piece) > len(freed):
                piece[:0] = freed
                freed = piece
            else:
                freed.extend(piece)
        self._evictable -= len(freed)
        self._evicted_pages += len(freed)
        return freed

    def _describe(self, leaf: Node, first: int, out: list[EvictedPage]) -> None:
        """Append ``leaf``'s pages from index ``first`` on, with their hashes and tokens."""
        hashes = leaf.page_hashes
        key, page_bytes = leaf.key, self._page_bytes
        for i in range(first, len(leaf.pages)):
            out.append(
                EvictedPage(leaf.pages[i], hashes[i], key[i * page_bytes : (i + 1) * page_bytes])
            )

    def walk_pages(self) -> list[EvictedPage]:
        """Every cached page with its content address and tokens (walks the whole tree)."""
        out: list[EvictedPage] = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self._describe(node, 0, out)
                stack.extend(node.children.values())
        return out

    # ----------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the tree.

        ``check_tree`` walks the nodes and counts what they hold; the counters and the LRU
        index kept here as the tree changes must agree with that count.
        """
        count = check_tree(self._roots, self._page_bytes, self._clock)
        assert count.evictable_pages == self._evictable, (
            f"evictable_pages {self._evictable} != {count.evictable_pages} counted in the tree"
        )
        assert count.protected_pages == self._protected, (
            f"protected_pages {self._protected} != {count.protected_pages} counted in the tree"
        )
        assert count.num_nodes == self._num_nodes, (
            f"num_nodes {self._num_nodes} != {count.num_nodes} nodes in the tree"
        )
        leaves = count.evictable_leaves
        assert len(self._lru) == len(leaves), (
            f"LRU index holds {len(self._lru)} leaves, the tree has {len(leaves)}"
        )
        for key, node in self._lru.items():
            assert leaves.get(key) is node, f"LRU index entry {key} is stale"


def _last_access(node: Node) -> int:
    return node.last_access
