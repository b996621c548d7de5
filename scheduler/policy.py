"""Waiting queues: the order in which waiting requests are offered for admission.

Every queue yields candidates lazily (the scheduler stops as soon as a step is full) and is
not changed while the scheduler walks it: admissions are applied after the walk.
In-batch grouping is not a queue's business: the scheduler defers a candidate whose prefix a
prefill in flight is computing, whatever the order (see ``PrefillClaims``).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from scheduler.request import Request


class WaitingQueue(ABC):
    """Waiting requests in policy order. ``match_length`` is the request's cached prefix."""

    @abstractmethod
    def push(self, request: Request, match_length: int) -> None: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[Request]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def update(self, request: Request, match_length: int) -> None:
        """The request's cached prefix changed (only policies that order by it care)."""
        return None

    def running_started(self, request: Request) -> None:
        """The request was admitted (policies that weigh running requests care)."""
        return None

    def running_ended(self, request: Request) -> None:
        """The request stopped running: finished, aborted or preempted."""
        return None


class FcfsQueue(WaitingQueue):
    """Arrival order."""

    def __init__(self) -> None:
        self._order: SortedList = SortedList()
        self._by_arrival: dict[int, Request] = {}

    def push(self, request: Request, match_length: int) -> None:
        self._order.add(request.arrival)
        self._by_arrival[request.arrival] = request

    def remove(self, request: Request) -> None:
        del self._by_arrival[request.arrival]
        self._order.remove(request.arrival)

    def candidates(self) -> Iterator[Request]:
        by_arrival = self._by_arrival
        for arrival in self._order:
            yield by_arrival[arrival]

    def __len__(self) -> int:
        return len(self._by_arrival)


class LpmQueue(WaitingQueue):
    """Longest cached prefix first; arrival order among equals.

    Kept sorted incrementally: a request moves only when its match length changes, which the
    scheduler learns from ``MatchIndex.refresh`` (no per-step re-matching).
    """

    def __init__(self) -> None:
        self._order: SortedList = SortedList()  # (-match_length, arrival)
        self._keys: dict[Request, tuple[int, int]] = {}
        self._by_arrival: dict[int, Request] = {}

    def push(self, request: Request, match_length: int) -> None:
        key = (-match_length, request.arrival)
        self._keys[request] = key
        self._by_arrival[request.arrival] = request
        self._order.add(key)

    def remove(self, request: Request) -> None:
        self._order.remove(self._keys.pop(request))
        del self._by_arrival[request.arrival]

    def update(self, request: Request, match_length: int) -> None:
        old = self._keys.get(request)
        if old is None or old[0] == -match_length:
            return
        self._order.remove(old)
        key = (-match_length, request.arrival)
        self._keys[request] = key
        self._order.add(key)

    def candidates(self) -> Iterator[Request]:
        by_arrival = self._by_arrival
        for _, arrival in self._order:
            yield by_arrival[arrival]

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(eq=False)
class _TrieNode:
    seq: int
    parent: _TrieNode | None
    key: Hashable
    weight: int = 0                                   # live requests in this subtree
    running: int = 0                                  # running requests in this subtree
    entered: int | None = None                        # when DFS entered it (None: not yet)
    order_key: tuple[int, int, int, int] = (1, 0, 0, 0)  # this node's key in parent.order
    matches: SortedList = field(default_factory=SortedList)  # waiting requests' cached prefixes
    waiting: dict[Request, None] = field(default_factory=dict)  # waiting requests ending here
    children: dict[Hashable, _TrieNode] = field(default_factory=dict)
    order: SortedList = field(default_factory=SortedList)  # children's order_key
    by_seq: dict[int, _TrieNode] = field(default_factory=dict)


class DfsWeightQueue(WaitingQueue):
    """Depth-first over a prefix trie of live requests, heavier subtrees first.

    The trie is keyed by prompt segments of doubling length (``base``, then ``base``, ``2 *
    base``, ``4 * base`` ... tokens), so a request costs O(log length) nodes. Siblings are
    visited entered subtrees first, in the order they were entered (one of their requests
    was admitted and some still wait: depth-first means finishing a subtree before starting
    the next, so the cache holds one group at a time), then the others by weight (live
    requests, waiting and running), then the longest cached prefix waiting in them (so among
    equals, such as the sessions of a chat, the ones whose history is still cached go
    first), then age. Requests ending at a node come before its children (their prompt is a
    prefix of the children's).
    """

    def __init__(self, base_tokens: int) -> None:
        if base_tokens < 1:
            raise ValueError(f"base_tokens: must be >= 1, got {base_tokens}")
        self._base = base_tokens
        self._seq = itertools.count()
        self._root = _TrieNode(next(self._seq), None, None)
        self._paths: dict[Request, list[_TrieNode]] = {}  # live requests -> nodes below root
        self._waiting: dict[Request, _TrieNode] = {}
        self._running: set[Request] = set()
        self._entries = itertools.count()
        self._match: dict[Request, int] = {}

    def push(self, request: Request, match_length: int) -> None:
        path = self._paths.get(request)
        if path is None:
            path = self._track(request)
        node = path[-1]
        node.waiting[request] = None
        self._waiting[request] = node
        self._match[request] = match_length
        for node in reversed(path):
            node.matches.add(match_length)
            self._rekey(node)

    def remove(self, request: Request) -> None:
        node = self._waiting.pop(request)
        del node.waiting[request]
        match_length = self._match.pop(request)
        path = self._paths[request]
        for node in reversed(path):
            node.matches.remove(match_length)
            self._rekey(node)
        if request not in self._running:
            self._untrack(request)

    def update(self, request: Request, match_length: int) -> None:
        old = self._match.get(request)
        if old is None or old == match_length:
            return
        self._match[request] = match_length
        for node in reversed(self._paths[request]):
            node.matches.remove(old)
            node.matches.add(match_length)
            self._rekey(node)

    def running_started(self, request: Request) -> None:
        if request not in self._paths:
            self._track(request)
        self._running.add(request)
        for node in self._paths[request]:
            node.running += 1
            if node.entered is None:
                node.entered = next(self._entries)
            self._rekey(node)

    def running_ended(self, request: Request) -> None:
        if request not in self._running:
            return
        self._running.discard(request)
        for node in self._paths[request]:
            node.running -= 1
            self._rekey(node)
        if request not in self._waiting:
            self._untrack(request)

    def candidates(self) -> Iterator[Request]:
        return self._walk(self._root)

    def __len__(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ internals

    def _walk(self, node: _TrieNode) -> Iterator[Request]:
        yield from list(node.waiting)
        by_seq = node.by_seq
        for *_, seq in list(node.order):
            child = by_seq.get(seq)
            if child is not None and child.weight > child.running:  # some of it waits
                yield from self._walk(child)

    def _segments(self, request: Request) -> list[Hashable]:
        tokens = request.prompt
        keys: list[Hashable] = [("namespace", request.namespace)]
        start, end = 0, self._base
        while end <= len(tokens):
            keys.append(tuple(tokens[start:end]))
            start, end = end, end * 2
        return keys

    def _track(self, request: Request) -> list[_TrieNode]:
        node = self._root
        path = []
        for key in self._segments(request):
            child = node.children.get(key)
            if child is None:
                child = _TrieNode(next(self._seq), node, key)
                child.order_key = (1, 0, 0, child.seq)
                node.children[key] = child
                node.by_seq[child.seq] = child
                node.order.add(child.order_key)
            path.append(child)
            node = child
        for child in path:
            child.weight += 1
            self._rekey(child)
        self._paths[request] = path
        return path

    def _untrack(self, request: Request) -> None:
        path = self._paths.pop(request)
        for child in reversed(path):
            child.weight -= 1
            self._rekey(child)
            if child.weight == 0 and not child.children:
                parent = child.parent
                assert parent is not None
                parent.order.remove(child.order_key)
                del parent.by_seq[child.seq]
                del parent.children[child.key]

    @staticmethod
    def _rekey(node: _TrieNode) -> None:
        parent = node.parent
        assert parent is not None
        if node.weight == node.running:
            node.entered = None  # nothing of it waits any more
        if node.entered is not None:
            key = (0, node.entered, 0, node.seq)
        else:
            best = node.matches[-1] if node.matches else 0
            key = (1, -node.weight, -best, node.seq)
        if key != node.order_key:
            parent.order.remove(node.order_key)
            node.order_key = key
            parent.order.add(key)


def make_queue(policy: str, page_size: int) -> WaitingQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "lpm":
        return LpmQueue()
    if policy == "dfs-weight":
        return DfsWeightQueue(base_tokens=max(page_size, 32))
    raise ValueError(f"policy: unknown policy {policy!r} (fcfs, lpm, dfs-weight)")
