"""Incremental prefix matches of waiting requests.

Re-matching thousands of waiting requests against the tree every step is what makes
longest-prefix-first scheduling collapse on long queues. Here each waiting request is matched
once, and again only when the tree changed exactly where its match ends:

- the tree grows along a request's path only by an insert whose new part starts at the
  request's match end and continues with the request's next page: each request is filed
  under that *frontier* (the page id at its match end + its next page's tokens);
- a request's match shrinks only when the last page of its match is evicted (eviction takes
  leaves' tail pages, so no page of a path goes before the pages below it): each request is
  filed under that *anchor* page.

Every insert and eviction goes through the KV manager, which announces it here
(``PagesStored``, ``PagesEvicted``), so a cached match is exact at the start of every step.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from radix import KVEvent, KVManager, PagesEvicted, PagesStored
from scheduler.request import Request


def root_anchor(namespace: str | None) -> Hashable:
    """The anchor of an empty match: a namespace's root (never equal to a page id)."""
    return ("root", namespace)


def matchable_length(request: Request, page_size: int) -> int:
    """The longest prefix a request may take from the tree: whole pages of all but the last
    token, whose logits give the next token and so must be computed; for a request that owes
    prompt log-probabilities, only whole pages of the positions already scored (a cached
    page has K/V but no logits)."""
    length = ((request.num_tokens - 1) // page_size) * page_size
    if request.scores_prompt:
        length = min(length, (request.scored // page_size) * page_size)
    return length


@dataclass(slots=True)
class WaitingMatch:
    length: int
    anchor: Hashable                      # last matched page id, or root_anchor(namespace)
    frontier: tuple[Hashable, tuple[int, ...]] | None  # (anchor, next page) if it can grow


class MatchIndex:
    """Each waiting request's cached match, kept exact by the KV manager's events."""

    def __init__(self, kv: KVManager) -> None:
        self._kv = kv
        self._page_size = kv.page_size
        self._matches: dict[Request, WaitingMatch] = {}
        self._by_anchor: dict[Hashable, set[Request]] = {}
        self._by_frontier: dict[tuple[Hashable, tuple[int, ...]], set[Request]] = {}
        self._dirty: set[Request] = set()
        self.rematches = 0  # match_prefix calls made here (a cost probe for benchmarks)
        kv.subscribe(self._on_kv_event)

    def __len__(self) -> int:
        return len(self._matches)

    def __contains__(self, request: Request) -> bool:
        return request in self._matches

    def get(self, request: Request) -> WaitingMatch:
        return self._matches[request]

    def add(self, request: Request) -> WaitingMatch:
        self._dirty.discard(request)
        return self._match(request)

    def remove(self, request: Request) -> None:
        match = self._matches.pop(request, None)
        self._dirty.discard(request)
        if match is not None:
            self._unfile(request, match)

    def _on_kv_event(self, event: KVEvent) -> None:
        if isinstance(event, PagesStored):
            parent = event.parent_page
            anchor = root_anchor(event.namespace) if parent is None else parent
            waiting = self._by_frontier.get((anchor, tuple(event.tokens[: self._page_size])))
            if waiting:
                self._dirty.update(waiting)
        elif isinstance(event, PagesEvicted):
            by_anchor = self._by_anchor
            for page in event.pages:
                waiting = by_anchor.get(page)
                if waiting:
                    self._dirty.update(waiting)

    def refresh(self) -> list[Request]:
        """Re-match the requests the tree changed under; returns those whose length changed."""
        changed = []
        for request in self._dirty:
            old = self._matches[request]
            self._unfile(request, old)
            if self._match(request).length != old.length:
                changed.append(request)
        self._dirty.clear()
        return changed

    # ------------------------------------------------------------------ internals

    def _match(self, request: Request) -> WaitingMatch:
        p = self._page_size
        tokens = request.all_tokens
        cap = matchable_length(request, p)
        found = self._kv.match(tokens[:cap], request.namespace)
        self.rematches += 1
        length = found.length
        anchor = found.pages[-1] if found.pages else root_anchor(request.namespace)
        frontier = None
        if length + p <= cap:
            frontier = (anchor, tuple(tokens[length : length + p]))
        match = WaitingMatch(length, anchor, frontier)
        self._matches[request] = match
        self._by_anchor.setdefault(anchor, set()).add(request)
        if frontier is not None:
            self._by_frontier.setdefault(frontier, set()).add(request)
        return match

    def _unfile(self, request: Request, match: WaitingMatch) -> None:
        _discard(self._by_anchor, match.anchor, request)
        if match.frontier is not None:
            _discard(self._by_frontier, match.frontier, request)


def _discard(index: dict, key: Hashable, request: Request) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(request)
        if not members:
            del index[key]
