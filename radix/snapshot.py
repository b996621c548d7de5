"""A bounded picture of the prefix tree for the inspector: ``snapshot_tree``.

Taken on the engine loop's thread, so its cost is a stall of the loop: it reads at most
``budget`` nodes, breadth first from every namespace's root (the shared prefixes near the top
first), each node's children most recently used first. What the budget leaves out is summed
up on its parent (how many children, how many tokens they hold themselves), not walked. It
copies plain numbers and a few token ids per node; decoding them to text is the reader's job,
off the loop.
"""

from __future__ import annotations

import heapq
from collections import deque

import msgspec

from radix.manager import KVManager
from radix.node import Node
from radix.tokens import TOKEN_BYTES, decode_tokens

DEFAULT_BUDGET = 400
HEAD_TOKENS = 12  # token ids kept per node: enough for a short label


class NodeView(msgspec.Struct, frozen=True):
    """One shown node: a run of ``pages`` pages holding ``tokens`` tokens that starts
    ``offset`` tokens into its namespace's prefixes. ``parent`` is the index of its parent
    in ``TreeSnapshot.nodes`` (-1: directly under its namespace's root). ``recency`` ranks
    its last use among the shown nodes (1.0 the newest, 0.0 the oldest). ``in_flight``: a
    running request holds it; ``pinned``: a pin keeps it. ``hidden_children`` children (and
    the ``hidden_tokens`` they hold themselves, their subtrees not counted) were left out by
    the budget."""

    namespace: int  # index into TreeSnapshot.namespaces
    parent: int
    offset: int
    tokens: int
    pages: int
    head: list[int]
    recency: float
    in_flight: bool
    pinned: bool
    hidden_children: int = 0
    hidden_tokens: int = 0


class NamespaceView(msgspec.Struct, frozen=True):
    """A namespace (None: the default one, else a request's ``cache_salt``) and what the
    snapshot left out right under its root."""

    name: str | None
    hidden_children: int = 0
    hidden_tokens: int = 0


class TreeSnapshot(msgspec.Struct, frozen=True):
    """At most ``budget`` nodes of a tree of ``total_nodes``, parents before children."""

    namespaces: list[NamespaceView]
    nodes: list[NodeView]
    total_nodes: int
    budget: int
    page_size: int

    @property
    def complete(self) -> bool:
        return len(self.nodes) == self.total_nodes


def snapshot_tree(
    kv: KVManager, budget: int = DEFAULT_BUDGET, head_tokens: int = HEAD_TOKENS
) -> TreeSnapshot:
    """Up to ``budget`` nodes of ``kv``'s tree, breadth first; call on the thread that owns
    ``kv`` (the engine loop). Costs O(nodes shown + the children of the nodes expanded)."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(f"budget: must be an int >= 0, got {budget!r}")
    tree = kv.tree
    pin_counts = _pin_counts(kv)
    names = tree.namespaces
    namespaces: list[NamespaceView] = []
    # (node, its namespace's index, its parent's index, tokens before it)
    queue: deque[tuple[Node, int, int, int]] = deque()
    left = budget
    for index, name in enumerate(names):
        root = tree.root(name)
        shown, hidden, hidden_tokens = _children(root, left)
        left -= len(shown)
        namespaces.append(NamespaceView(name, hidden, hidden_tokens))
        queue.extend((child, index, -1, 0) for child in shown)
    rows: list[tuple[Node, int, int, int]] = []
    hidden_of: list[tuple[int, int]] = []
    while queue:
        node, namespace, parent, offset = queue.popleft()
        here = len(rows)
        rows.append((node, namespace, parent, offset))
        shown, hidden, hidden_tokens = _children(node, left)
        left -= len(shown)
        hidden_of.append((hidden, hidden_tokens))
        below = offset + len(node.key) // TOKEN_BYTES
        queue.extend((child, namespace, here, below) for child in shown)
    order = sorted(range(len(rows)), key=lambda i: rows[i][0].last_access)
    recency = [0.0] * len(rows)
    for rank, i in enumerate(order):
        recency[i] = rank / (len(order) - 1) if len(order) > 1 else 1.0
    head_bytes = head_tokens * TOKEN_BYTES
    nodes = []
    for i, (node, namespace, parent, offset) in enumerate(rows):
        pins = pin_counts.get(id(node), 0)
        nodes.append(
            NodeView(
                namespace=namespace,
                parent=parent,
                offset=offset,
                tokens=len(node.key) // TOKEN_BYTES,
                pages=len(node.pages),
                head=decode_tokens(node.key[:head_bytes]),
                recency=recency[i],
                in_flight=node.lock_ref > pins,
                pinned=pins > 0,
                hidden_children=hidden_of[i][0],
                hidden_tokens=hidden_of[i][1],
            )
        )
    return TreeSnapshot(namespaces, nodes, tree.num_nodes, budget, kv.page_size)


def _children(node: Node, left: int) -> tuple[list[Node], int, int]:
    """The children to show (at most ``left``, the most recently used), how many are not
    shown and the tokens those hold themselves."""
    children = node.children
    if len(children) <= left:
        return list(children.values()), 0, 0
    shown = heapq.nlargest(max(left, 0), children.values(), key=_last_access)
    kept = {id(child) for child in shown}
    hidden_tokens = sum(len(c.key) for c in children.values() if id(c) not in kept)
    return shown, len(children) - len(shown), hidden_tokens // TOKEN_BYTES


def _pin_counts(kv: KVManager) -> dict[int, int]:
    """id(node) -> how many live pins hold a lock through it (each pin locks its path)."""
    counts: dict[int, int] = {}
    for pin in kv.pins:
        node: Node | None = pin.node
        while node is not None and node.parent is not None:
            counts[id(node)] = counts.get(id(node), 0) + 1
            node = node.parent
    return counts


def _last_access(node: Node) -> int:
    return node.last_access
