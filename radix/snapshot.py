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

import msgspec

from radix.manager import KVManager
from radix.node import Node
from radix.tokens import TOKEN_BYTES, decode_tokens

DEFAULT_BUDGET = 400
HEAD_TOKENS = 12  # token ids kept per node: enough for a short label


class NodeView(msgspec.Struct, frozen=True, gc=False):
    """One shown node: a run of ``pages`` pages holding ``tokens`` tokens that starts
    ``offset`` tokens into its namespace's prefixes. ``parent`` is the index of its parent
    in ``TreeSnapshot.nodes`` (-1: directly under its namespace's root). ``recency`` ranks
    its last use among the shown nodes (1.0 the newest, 0.0 the oldest). ``in_flight``: a
    running request holds it; ``pinned``: a pin keeps it. ``hidden_children`` children (and
    the ``hidden_tokens`` they hold themselves, their subtrees not counted) were left out by
    the budget. ``head_bytes``: its first token ids as canonical bytes (``head``), and no
    field the garbage collector tracks: a snapshot of 10k nodes on the loop thread must not
    set off a collection of the engine's whole heap."""

    namespace: int  # index into TreeSnapshot.namespaces
    parent: int
    offset: int
    tokens: int
    pages: int
    head_bytes: bytes
    recency: float
    in_flight: bool
    pinned: bool
    hidden_children: int = 0
    hidden_tokens: int = 0

    @property
    def head(self) -> list[int]:
        """The node's first token ids (a label's source)."""
        return decode_tokens(self.head_bytes)


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
    ``kv`` (the engine loop). Costs O(nodes shown + the children of the nodes expanded), in
    flat lists (no per-node tuple or list for the garbage collector to count)."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(f"budget: must be an int >= 0, got {budget!r}")
    tree = kv.tree
    pin_counts = _pin_counts(kv)
    namespaces: list[NamespaceView] = []
    # The shown nodes in breadth-first order, each node's fields in parallel lists; the
    # cursor walks them as the queue.
    nodes: list[Node] = []
    spaces: list[int] = []
    parents: list[int] = []
    offsets: list[int] = []
    for index, name in enumerate(tree.namespaces):
        root = tree.root(name)
        added, hidden, hidden_tokens = _take_children(root, budget - len(nodes), nodes)
        namespaces.append(NamespaceView(name, hidden, hidden_tokens))
        spaces.extend([index] * added)
        parents.extend([-1] * added)
        offsets.extend([0] * added)
    hidden_counts: list[int] = []
    hidden_token_counts: list[int] = []
    cursor = 0
    while cursor < len(nodes):
        node = nodes[cursor]
        added, hidden, hidden_tokens = _take_children(node, budget - len(nodes), nodes)
        hidden_counts.append(hidden)
        hidden_token_counts.append(hidden_tokens)
        spaces.extend([spaces[cursor]] * added)
        parents.extend([cursor] * added)
        offsets.extend([offsets[cursor] + len(node.key) // TOKEN_BYTES] * added)
        cursor += 1
    count = len(nodes)
    order = sorted(range(count), key=lambda i: nodes[i].last_access)
    recency = [1.0] * count
    for rank, i in enumerate(order):
        recency[i] = rank / (count - 1) if count > 1 else 1.0
    head_bytes = head_tokens * TOKEN_BYTES
    views = [
        NodeView(
            namespace=spaces[i],
            parent=parents[i],
            offset=offsets[i],
            tokens=len(node.key) // TOKEN_BYTES,
            pages=len(node.pages),
            head_bytes=node.key[:head_bytes],
            recency=recency[i],
            in_flight=node.lock_ref > pin_counts.get(id(node), 0),
            pinned=id(node) in pin_counts,
            hidden_children=hidden_counts[i],
            hidden_tokens=hidden_token_counts[i],
        )
        for i, node in enumerate(nodes)
    ]
    return TreeSnapshot(namespaces, views, tree.num_nodes, budget, kv.page_size)


def _take_children(node: Node, left: int, out: list[Node]) -> tuple[int, int, int]:
    """Append the children to show to ``out`` (at most ``left``, the most recently used);
    returns how many were added, how many were not and the tokens those hold themselves."""
    children = node.children
    if len(children) <= left:
        out.extend(children.values())
        return len(children), 0, 0
    shown = heapq.nlargest(max(left, 0), children.values(), key=_last_access)
    out.extend(shown)
    hidden_bytes = sum(len(c.key) for c in children.values()) - sum(len(c.key) for c in shown)
    return len(shown), len(children) - len(shown), hidden_bytes // TOKEN_BYTES


def _pin_counts(kv: KVManager) -> dict[int, int]:
    """id(node) -> how many live pins hold a lock through it (each pin locks its path)."""
    counts: dict[int, int] = {}
    for pin in kv.pins.live():
        node: Node | None = pin.node
        while node is not None and node.parent is not None:
            counts[id(node)] = counts.get(id(node), 0) + 1
            node = node.parent
    return counts


def _last_access(node: Node) -> int:
    return node.last_access
