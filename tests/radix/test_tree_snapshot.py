"""The inspector's tree snapshot: within its node budget, the rest summed on the parents,
pinned and in-flight paths marked, recency ranked, and the tree left as it was."""

from __future__ import annotations

import pytest

from radix import KVManager
from radix.snapshot import snapshot_tree
from radix.tokens import encode_tokens

PAGE = 4


def cached(kv: KVManager, tokens: list[int], namespace: str | None = None) -> None:
    """Run one request through the manager: its whole pages end up in the tree."""
    handle = kv.acquire(tokens, namespace)
    assert kv.allocate(handle, len(tokens))
    kv.release(handle, tokens)


def fan(kv: KVManager, branches: int, stem: list[int]) -> None:
    for b in range(branches):
        cached(kv, stem + [1000 + b] * PAGE)


def test_a_snapshot_within_budget_shows_every_node_parents_first() -> None:
    kv = KVManager(num_pages=256, page_size=PAGE)
    fan(kv, 5, list(range(1, 9)))
    cached(kv, [7] * 12, namespace="tenant")
    snap = snapshot_tree(kv, budget=100)
    assert snap.complete and len(snap.nodes) == snap.total_nodes == kv.tree.num_nodes == 7
    for i, node in enumerate(snap.nodes):
        assert node.parent < i
        assert node.tokens == node.pages * PAGE
        assert node.hidden_children == 0
    names = [ns.name for ns in snap.namespaces]
    assert names == [None, "tenant"]
    stem = snap.nodes[0]
    assert stem.head == list(range(1, 9)) and stem.offset == 0
    children = [n for n in snap.nodes if n.parent == 0]
    assert len(children) == 5 and all(c.offset == 8 for c in children)


def test_the_budget_bounds_the_nodes_and_the_rest_is_summed_on_the_parent() -> None:
    kv = KVManager(num_pages=512, page_size=PAGE)
    fan(kv, 40, list(range(1, 9)))
    snap = snapshot_tree(kv, budget=10)
    assert len(snap.nodes) == 10 and snap.total_nodes == 41 and not snap.complete
    stem = snap.nodes[0]
    assert stem.hidden_children == 40 - 9
    assert stem.hidden_tokens == (40 - 9) * PAGE
    assert snapshot_tree(kv, budget=0).nodes == []
    assert snapshot_tree(kv, budget=0).namespaces[0].hidden_children == 1


def test_the_most_recently_used_children_are_the_ones_shown() -> None:
    kv = KVManager(num_pages=512, page_size=PAGE)
    stem = list(range(1, 9))
    fan(kv, 20, stem)
    kv.match(stem + [1000 + 3] * PAGE)  # branch 3 is now the newest
    snap = snapshot_tree(kv, budget=2)
    assert [n.head[0] for n in snap.nodes] == [1, 1003]
    assert snap.nodes[1].recency == 1.0 and snap.nodes[0].recency == 0.0


def test_pinned_and_in_flight_paths_are_marked_apart() -> None:
    kv = KVManager(num_pages=256, page_size=PAGE)
    a, b = list(range(1, 13)), [50] * 12
    cached(kv, a)
    cached(kv, b)
    kv.pins.pin(a, None, ttl=60, now=0.0)
    running = kv.acquire(b)
    snap = snapshot_tree(kv)
    by_head = {n.head[0]: n for n in snap.nodes}
    assert by_head[1].pinned and not by_head[1].in_flight
    assert by_head[50].in_flight and not by_head[50].pinned
    kv.release(running)
    after = {n.head[0]: n for n in snapshot_tree(kv).nodes}
    assert not after[50].in_flight


def test_a_snapshot_changes_nothing_in_the_tree() -> None:
    kv = KVManager(num_pages=512, page_size=PAGE)
    fan(kv, 30, list(range(1, 9)))

    def branches() -> list[tuple[int, bool]]:
        stem = kv.tree.root().children[encode_tokens(range(1, 1 + PAGE))]
        return [(n.last_access, n.in_lru) for n in stem.children.values()]

    before = branches()
    snapshot_tree(kv, budget=7)
    assert before == branches()
    kv.check([])


@pytest.mark.parametrize("budget", [-1, 1.5, True])
def test_a_bad_budget_is_refused(budget: object) -> None:
    with pytest.raises(ValueError, match="budget"):
        snapshot_tree(KVManager(num_pages=8, page_size=PAGE), budget)  # type: ignore[arg-type]
