"""Pins: cached prefixes kept in the pool for a while (a stored conversation between turns).

A pin is a lock on the node where a cached prefix ends, like a running request's, with a
lifetime. Its pages are never evicted while it lives; when it expires, is dropped, or gives
way past the budget (a share of the pool), the lock goes and its pages are ordinary LRU
leaves again: evicted in turn, and written down to the host and disk tiers on the way out
where there are tiers. Pinned pages are the union of the pinned paths (a system prompt under
many conversations counts once). Past the budget the pin that gives way is the oldest of the
namespace (tenant) pinning the most pages, so one tenant's flood of pins ends its own first,
never another's while it holds more.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from radix.cache import RadixCache
from radix.node import Node


@dataclass(eq=False)
class Pin:
    """A pinned prefix: ``length`` tokens of ``namespace`` ending at ``node``, until
    ``expires`` (the caller's clock). ``active`` turns False when it is released."""

    id: int
    namespace: str | None
    node: Node
    length: int
    expires: float
    active: bool = True


@dataclass
class PinTable:
    """The live pins of one tree, oldest first, within ``max_pages`` pinned pages. The
    ``KVManager`` of the tree exposes it as ``kv.pins``; like the tree, it is changed only on
    the engine loop's thread."""

    tree: RadixCache
    max_pages: int
    pins: dict[int, Pin] = field(default_factory=dict)
    released: int = 0  # pins ended by expiry or the budget (only grows)
    _ids: itertools.count = field(default_factory=itertools.count)
    # Read every step (stats, the loop's expiry check), changed only by adding and releasing
    # a pin (a pinned path never changes: its nodes are locked): computed once per change.
    _pinned: int | None = None
    _next: float | None = None
    _known: bool = False  # whether _pinned and _next are up to date

    def pin(
        self, tokens: Sequence[int], namespace: str | None, ttl: float, now: float
    ) -> Pin | None:
        """Keep the cached prefix of ``tokens`` in the pool until ``now + ttl`` (None: nothing
        of it is cached). Past the budget the oldest pins are released, this one too if it
        alone is over."""
        if ttl <= 0:
            raise ValueError(f"ttl: must be > 0 seconds, got {ttl!r}")
        found = self.tree.match_prefix(tokens, namespace)
        if found.length == 0:
            return None
        return self.add(found.node, namespace, found.length, now + ttl)

    def live(self) -> list[Pin]:
        """The live pins, oldest first (for reading: the inspector marks their paths)."""
        return list(self.pins.values())

    def add(self, node: Node, namespace: str | None, length: int, expires: float) -> Pin:
        """Pin ``node`` (locked here), then release the oldest pins while over the budget
        (the new one too, if it alone is over)."""
        self.tree.lock(node)
        pin = Pin(next(self._ids), namespace, node, length, expires)
        self.pins[pin.id] = pin
        self._known = False
        while self.pins and self.pinned_pages() > self.max_pages:
            self.release_oldest()
        return pin

    def drop(self, pin: Pin) -> None:
        """End ``pin`` (nothing if it already ended)."""
        if pin.active:
            self._release(pin)

    def drop_prefix(self, tokens: Sequence[int], namespace: str | None) -> int:
        """End the pins of ``namespace`` on a finished request's ``tokens`` (prompt and
        output): a pin on exactly the pages it cached, those of every token but the last
        (whose KV was never computed), not a shorter one on their path (an earlier turn,
        still stored, keeps its own). How many ended."""
        computed = max(0, len(tokens) - 1)
        whole = computed - computed % self.tree.page_size
        ended = [
            pin for pin in self.pins.values()
            if pin.namespace == namespace and pin.length == whole
            and self.tree.match_prefix(tokens[:whole], namespace).node is pin.node
        ]
        for pin in ended:
            self._release(pin)
        return len(ended)

    def expire(self, now: float) -> list[Pin]:
        """Release every pin whose lifetime ended by ``now`` (called every step: nothing to
        walk before the first lifetime ends)."""
        first = self.next_expiry()
        if first is None or first > now:
            return []
        ended = [pin for pin in self.pins.values() if pin.expires <= now]
        for pin in ended:
            self._release(pin)
        self.released += len(ended)
        return ended

    def release_oldest(self) -> bool:
        """Release the oldest pin of the namespace pinning the most pages (past the budget,
        or a request that cannot fit beside the pins needs its pages); False when there are
        none."""
        if not self.pins:
            return False
        heaviest = max(self._pages_by_namespace().items(), key=lambda kv: kv[1])[0]
        self._release(next(p for p in self.pins.values() if p.namespace == heaviest))
        self.released += 1
        return True

    def _pages_by_namespace(self) -> dict[str | None, int]:
        """Pinned pages per namespace, first pinned first (ties go to the namespace of the
        oldest pin). Namespaces share no nodes (their hashes are seeded apart)."""
        seen: set[int] = set()
        pages: dict[str | None, int] = {}
        for pin in self.pins.values():
            node: Node | None = pin.node
            count = 0
            while node is not None and id(node) not in seen:
                seen.add(id(node))
                count += len(node.pages)
                node = node.parent
            pages[pin.namespace] = pages.get(pin.namespace, 0) + count
        return pages

    def next_expiry(self) -> float | None:
        """When the first live pin ends (None: no pins)."""
        self._refresh()
        return self._next

    def pinned_pages(self) -> int:
        """Pages on the union of the pinned paths."""
        self._refresh()
        assert self._pinned is not None
        return self._pinned

    def _refresh(self) -> None:
        if not self._known:
            self._pinned = self._count_pinned()
            self._next = min((pin.expires for pin in self.pins.values()), default=None)
            self._known = True

    def _count_pinned(self) -> int:
        seen: set[int] = set()
        pages = 0
        for pin in self.pins.values():
            node: Node | None = pin.node
            while node is not None and id(node) not in seen:
                seen.add(id(node))
                pages += len(node.pages)
                node = node.parent
        return pages

    def _release(self, pin: Pin) -> None:
        pin.active = False
        del self.pins[pin.id]
        self.tree.unlock(pin.node)
        self._known = False
