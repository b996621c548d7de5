"""Why a request's prompt was not all cached: ``MissTracker`` names it at admission.

A prompt's tokens past its cached prefix were computed for one of four reasons, checked in
this order on the first page that missed:

- ``evicted``: that page's content address (the chain hash the tree gives it) was in the
  pool and was evicted; the tracker remembers the last ``max_hashes`` evicted addresses
  (a page is out of the pool only by eviction, so an address stored again needs no
  forgetting: if it is missed later, it was evicted again);
- ``other_namespace``: another namespace (another ``cache_salt``) holds more of the prompt;
  the tree never shares across namespaces, by design;
- ``never_seen``: none of the above;
- ``page_boundary``: nothing whole-page was missed; the tokens left are the unaligned tail
  and the last page, which a request always computes (its last token's logits are needed).

Kept small: a bounded set of hashes, a ring of the last ``keep`` reports, one hash and a
read-only walk per other namespace (at most ``max_namespaces``) per admitted request.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import msgspec
import xxhash

from radix.manager import KVManager, PagesEvicted
from radix.node import Node
from radix.tokens import TOKEN_BYTES, encode_tokens

REASONS = ("hit", "evicted", "other_namespace", "never_seen", "page_boundary")


class RequestMiss(msgspec.Struct, frozen=True):
    """One admitted request: of ``prompt_tokens``, ``cached_tokens`` came from the cache
    (pool or tiers), ``missed_tokens`` whole-page tokens were computed for ``reason``, and
    ``boundary_tokens`` were past the last page it could take from the tree. ``at`` is the
    wall-clock time of admission; ``head`` the prompt's first token ids (a label), ``tail``
    the first ones it computed (where it left the cache)."""

    at: float
    namespace: str | None
    prompt_tokens: int
    cached_tokens: int
    missed_tokens: int
    boundary_tokens: int
    reason: str
    head: list[int]
    tail: list[int]


class MissTracker:
    """Follows ``kv``'s evictions and names the reason of each admitted request's misses."""

    def __init__(
        self,
        kv: KVManager,
        keep: int = 64,
        max_hashes: int = 1 << 16,
        max_namespaces: int = 16,
        head_tokens: int = 16,
    ) -> None:
        self._kv = kv
        self._evicted: OrderedDict[int, None] = OrderedDict()
        self._max_hashes = max_hashes
        self._max_namespaces = max_namespaces
        self._head_tokens = head_tokens
        self.recent: deque[RequestMiss] = deque(maxlen=keep)
        kv.subscribe_evictions(self._on_evicted)

    def _on_evicted(self, event: PagesEvicted) -> None:
        evicted = self._evicted
        for key in event.hashes:
            evicted[key] = None
            evicted.move_to_end(key)
        while len(evicted) > self._max_hashes:
            evicted.popitem(last=False)

    def admitted(
        self,
        prompt: Sequence[int],
        namespace: str | None,
        cached: int,
        matchable: int,
        node: Node,
    ) -> RequestMiss:
        """Record one request at its first admission: ``cached`` tokens of ``prompt`` were
        found (ending at ``node``, the handle's locked node) of the ``matchable`` it could
        have taken from the tree."""
        p = self._kv.page_size
        missed = max(matchable - cached, 0)
        if missed == 0:
            reason = "page_boundary" if cached < len(prompt) else "hit"
        else:
            reason = self._reason(prompt, namespace, cached, matchable, node, p)
        report = RequestMiss(
            at=time.time(),
            namespace=namespace,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            missed_tokens=missed,
            boundary_tokens=len(prompt) - max(matchable, cached),
            reason=reason,
            head=list(prompt[: self._head_tokens]),
            tail=list(prompt[cached : cached + self._head_tokens]),
        )
        self.recent.append(report)
        return report

    def _reason(
        self,
        prompt: Sequence[int],
        namespace: str | None,
        cached: int,
        matchable: int,
        node: Node,
        p: int,
    ) -> str:
        page = encode_tokens(prompt[cached : cached + p])
        if xxhash.xxh3_64_intdigest(page, node.hash) in self._evicted:
            return "evicted"
        buf = encode_tokens(prompt[:matchable])
        tree = self._kv.tree
        checked = 0
        for other in tree.namespaces:
            if other == namespace:
                continue
            if checked == self._max_namespaces:
                break
            checked += 1
            if _held_length(tree.root(other), buf, p * TOKEN_BYTES) > cached * TOKEN_BYTES:
                return "other_namespace"
        return "never_seen"


def _held_length(root: Node, buf: bytes, page_bytes: int) -> int:
    """Bytes of ``buf`` (whole pages) the subtree under ``root`` holds; reads only (no
    split, no LRU touch)."""
    node, pos = root, 0
    while pos + page_bytes <= len(buf):
        child = node.children.get(buf[pos : pos + page_bytes])
        if child is None:
            break
        key = child.key
        if buf.startswith(key, pos):
            pos += len(key)
            node = child
            continue
        step = pos
        while step + page_bytes <= len(buf) and buf[step : step + page_bytes] == key[
            step - pos : step - pos + page_bytes
        ]:
            step += page_bytes
        return step
    return pos
