"""Draft tokens for speculative decoding, read from what the engine already holds.

No draft model: a decoding request's next tokens are guessed from
1. the radix tree: the continuation an earlier request with exactly this sequence generated
   (``n`` choices run one after another, retries, regenerations, replays);
2. the request's own context: the tokens that followed the last earlier occurrence of its
   latest n-gram (an answer quoting its document, an agent re-emitting a file);
3. what the other running requests of the same namespace have generated, by n-gram (the same
   question asked by several users at once, agents filling one schema side by side): their
   answers reach the tree only when they finish;
4. the tree's other sequences of the same namespace, by n-gram (the same question asked with a
   different preamble), indexed from the manager's ``PagesStored`` events (and the partial last
   page of each finished request, which the tree does not keep), bounded.

Sources 2-4 match the sequence's last 1 to 4 tokens; the draft read after the longest match
wins (ties: the order above), and the match length goes with it, since the gate learns how often
each length is right (a 4-token match is accepted about twice as often as a 1-token one).
A guess costs nothing to make and is checked by the model in the verify pass; only the tokens
the model would have picked anyway are kept. Nothing here crosses a namespace.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat

import msgspec

from radix import KVEvent, KVManager, PagesStored
from scheduler.request import Request

# n-gram lengths tried on the request's own context and in the namespace index, longest first.
CONTEXT_NGRAMS = (4, 3, 2, 1)
NAMESPACE_NGRAMS = (4, 3, 2, 1)
LONGEST_NGRAM = max(*CONTEXT_NGRAMS, *NAMESPACE_NGRAMS)
# n-gram length of the running peers' index.
PEER_NGRAM = 4
# How many n-grams the namespace index keeps (LRU; about 250 bytes each).
NAMESPACE_INDEX_CAPACITY = 1 << 17


class DraftSource(enum.Enum):
    TREE = "tree"  # the tree's continuation of the exact sequence
    CONTEXT = "context"  # an n-gram of the request's own tokens
    PEER = "peer"  # an n-gram of what a running request of the namespace generated
    NAMESPACE = "namespace"  # an n-gram of the namespace's cached sequences


class Draft(msgspec.Struct, frozen=True):
    """Proposed next tokens, where they were read, and how many of the sequence's last tokens
    matched there (the tree's continuation matches the whole sequence). Frozen: ``NO_DRAFT``
    is shared."""

    tokens: list[int]
    source: DraftSource | None = None
    match: int = 0


NO_DRAFT = Draft([])


class ContextIndex:
    """Where each n-gram of one request's tokens last occurred, kept up to date as the request
    grows (each token is indexed once)."""

    __slots__ = ("tokens", "_last", "_indexed")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in CONTEXT_NGRAMS}
        self._indexed = 0  # continuations starting up to here are indexed

    def sync(self, request: Request) -> None:
        """Take in the request's tokens appended since the last call."""
        tokens = self.tokens
        have = len(tokens)
        prompt = request.prompt
        if have < len(prompt):
            tokens.extend(prompt[have:])
            have = len(prompt)
        tokens.extend(request.output[have - len(prompt) :])
        # Entries map an n-gram to where its continuation starts. The n-gram ending at the
        # last token is the query, not an entry: continuations start at the last token at most.
        # Built by zip over shifted slices (a prompt of thousands of tokens is indexed at its
        # first draft, in C), later positions overwriting earlier ones.
        end = len(tokens) - 1
        for n, last in self._last.items():
            low = max(n, self._indexed + 1)
            if low <= end:
                grams = zip(*(tokens[low - n + i : end - n + i + 1] for i in range(n)))
                last.update(zip(grams, range(low, end + 1)))
        self._indexed = max(self._indexed, end)

    def lookup(self, max_tokens: int) -> tuple[list[int], int]:
        """The tokens after the last earlier occurrence of the latest n-gram, longest n first,
        and that n (0: no n-gram occurred before)."""
        tokens = self.tokens
        for n, last in self._last.items():
            if len(tokens) <= n:
                continue
            found = last.get(tuple(tokens[-n:]))
            if found is not None:
                return tokens[found : found + max_tokens], n
        return [], 0


class PeerIndex:
    """Where each ``PEER_NGRAM``-gram of the running requests' generated tokens first occurred,
    per namespace (the first writer is the request furthest ahead in that phrase, so its
    continuation is the longest). Values point into the requests' ``ContextIndex`` tokens, which
    only grow; a request's entries go when it ends, so the index holds what is running."""

    def __init__(self) -> None:
        self._first: dict[tuple[str | None, tuple[int, ...]], tuple[ContextIndex, int]] = {}
        # Each request's namespace and the continuations it has entered: [low, high).
        self._indexed: dict[ContextIndex, tuple[str | None, int, int]] = {}

    def __len__(self) -> int:
        return len(self._first)

    def add(self, namespace: str | None, context: ContextIndex, prompt_len: int) -> None:
        """Take in ``context``'s tokens since the last call: entries whose continuation starts
        in its output (a prompt is in the tree already, or private to its request)."""
        n, tokens, first = PEER_NGRAM, context.tokens, self._first
        low = max(n, prompt_len)
        _, low, high = self._indexed.get(context, (namespace, low, low))
        # As in ContextIndex, the n-gram ending at the last token is a query, not an entry.
        for cont in range(high, len(tokens)):
            first.setdefault((namespace, tuple(tokens[cont - n : cont])), (context, cont))
        self._indexed[context] = (namespace, low, max(high, len(tokens)))

    def lookup(self, namespace: str | None, context: ContextIndex, max_tokens: int) -> list[int]:
        """What a peer generated after ``context``'s latest n-gram."""
        tokens = context.tokens
        if len(tokens) < PEER_NGRAM:
            return []
        found = self._first.get((namespace, tuple(tokens[-PEER_NGRAM:])))
        if found is None or found[0] is context:
            return []
        peer, cont = found
        return peer.tokens[cont : cont + max_tokens]

    def remove(self, context: ContextIndex) -> None:
        """``context``'s request ended: its entries go."""
        indexed = self._indexed.pop(context, None)
        if indexed is None:
            return
        namespace, low, high = indexed
        n, tokens, first = PEER_NGRAM, context.tokens, self._first
        for cont in range(low, high):
            key = (namespace, tuple(tokens[cont - n : cont]))
            found = first.get(key)
            if found is not None and found[0] is context:
                del first[key]


class NamespaceIndex:
    """The latest continuation of each n-gram (``NAMESPACE_NGRAMS`` long) stored in the tree,
    per namespace; at most ``capacity`` n-grams (least recently stored dropped first). Entries
    outlive their pages' eviction: a draft is only a guess, and a stale one costs a rejected
    row."""

    def __init__(self, max_tokens: int, capacity: int = NAMESPACE_INDEX_CAPACITY) -> None:
        self._max_tokens = max_tokens
        self._capacity = capacity
        self._next: OrderedDict[tuple[str | None, tuple[int, ...]], tuple[int, ...]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._next)

    def on_event(self, event: KVEvent) -> None:
        if isinstance(event, PagesStored):
            self.add(event.namespace, event.tokens)

    def add(self, namespace: str | None, tokens: Sequence[int]) -> None:
        """Enter ``tokens``' n-grams as the most recently stored (each an update in C: the
        events carry whole prompts' pages)."""
        k, entries = self._max_tokens, self._next
        tokens = list(tokens)
        size = len(tokens)
        # The continuation after position cont - 1, one tuple for every n-gram ending there.
        after = [tuple(tokens[cont : cont + k]) for cont in range(1, size)]
        for n in NAMESPACE_NGRAMS:
            if size <= n:
                continue
            keys = list(zip(repeat(namespace), zip(*(tokens[i : size - n + i] for i in range(n)))))
            deque(map(entries.pop, keys, repeat(None)), maxlen=0)  # re-entered at the end
            entries.update(zip(keys, after[n - 1 :]))
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def lookup(
        self, namespace: str | None, tokens: Sequence[int], max_tokens: int, longer_than: int = 0
    ) -> tuple[list[int], int]:
        """The latest continuation of ``tokens``' longest indexed last n-gram with n over
        ``longer_than``, and that n (0: none)."""
        entries = self._next
        for n in NAMESPACE_NGRAMS:
            if n <= longer_than:
                break
            if len(tokens) < n:
                continue
            found = entries.get((namespace, tuple(tokens[-n:])))
            if found:
                return list(found[:max_tokens]), n
        return [], 0


def best_draft(
    tree: list[int], context: ContextIndex, peers: PeerIndex, namespaces: NamespaceIndex,
    namespace: str | None, max_tokens: int,
) -> Draft:
    """The draft read after the longest match of ``context``'s last tokens: ``tree`` (the
    tree's continuation of the whole sequence) if any, else the longest n-gram match in the
    request's own tokens, its running peers' and its namespace's (ties in that order)."""
    if tree:
        return Draft(tree, DraftSource.TREE, len(context.tokens))
    own, n = context.lookup(max_tokens)
    best = Draft(own, DraftSource.CONTEXT, n) if own else NO_DRAFT
    if best.match < PEER_NGRAM:
        peer = peers.lookup(namespace, context, max_tokens)
        if peer:
            best = Draft(peer, DraftSource.PEER, PEER_NGRAM)
    if best.match < LONGEST_NGRAM:
        cached, n = namespaces.lookup(namespace, context.tokens, max_tokens, best.match)
        if cached:
            best = Draft(cached, DraftSource.NAMESPACE, n)
    return best


class Drafter:
    """Proposes draft tokens for decoding requests from the four sources above."""

    def __init__(self, kv: KVManager, max_tokens: int) -> None:
        self._kv = kv
        self._contexts: dict[Request, ContextIndex] = {}
        self.peers = PeerIndex()
        self.namespaces = NamespaceIndex(max_tokens)
        kv.subscribe(self.namespaces.on_event)

    def sync(self, request: Request) -> ContextIndex:
        """Index ``request``'s tokens appended since the last call (its own context, and what
        its peers may draft from)."""
        context = self._contexts.get(request)
        if context is None:
            context = self._contexts[request] = ContextIndex()
        context.sync(request)
        self.peers.add(request.namespace, context, len(request.prompt))
        return context

    def propose_all(self, wants: Sequence[tuple[Request, int]]) -> list[Draft]:
        """``propose`` for each (request, max tokens), every request indexed first: a peer's
        token sampled in the last step is already there to draft from."""
        contexts = [self.sync(request) if n > 0 else None for request, n in wants]
        return [NO_DRAFT if context is None else self._lookup(request, context, n)
                for (request, n), context in zip(wants, contexts)]

    def propose(self, request: Request, max_tokens: int) -> Draft:
        """Up to ``max_tokens`` guesses of what ``request`` (decoding: its last token is
        sampled, its K/V not yet computed) generates next."""
        if max_tokens <= 0:
            return NO_DRAFT
        return self._lookup(request, self.sync(request), max_tokens)

    def _lookup(self, request: Request, context: ContextIndex, max_tokens: int) -> Draft:
        """The sources, for a request whose context is indexed."""
        handle = request.kv
        tree: list[int] = []
        if handle is not None and self._kv.prefix_cache:
            after = context.tokens[handle.cached_len :]
            tree = self._kv.continuation(handle, after, max_tokens)
        return best_draft(tree, context, self.peers, self.namespaces, request.namespace,
                          max_tokens)

    def finished(self, request: Request) -> None:
        """The request finished: the tree keeps only its whole pages, so the index also learns
        the tail after the last one (what a regeneration of a short answer needs)."""
        tokens = request.all_tokens
        page_size = self._kv.page_size
        start = max(0, len(tokens) - len(tokens) % page_size - LONGEST_NGRAM)
        self.namespaces.add(request.namespace, tokens[start:])
        self.forget(request)

    def forget(self, request: Request) -> None:
        """The request ended: drop its context index and its entries in the peers'."""
        context = self._contexts.pop(request, None)
        if context is not None:
            self.peers.remove(context)
