"""The namespace index (the latest continuation of each 1- to 4-gram the tree stored, per
namespace) under random sequences added in two namespaces and random lookups.

An index large enough to keep everything answers every lookup exactly as a scan of what was
added does: the continuation after the latest occurrence of the query's longest last n-gram
(longer than asked for) in its own namespace, and that n. A small index never holds more than
its capacity, and what it answers is always a true continuation in the query's namespace.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from scheduler.speculation.drafter import NAMESPACE_NGRAMS, NamespaceIndex

token_st = st.integers(0, 3)  # a small alphabet: n-grams recur across sequences
namespace_st = st.sampled_from(["a", "b", None])
MAX_TOKENS = 5
SMALL = 12


def scan(added: list[tuple[str | None, list[int]]], namespace: str | None, query: list[int],
         max_tokens: int, longer_than: int) -> tuple[list[int], int]:
    """The index's answer, by brute force over everything added (in order)."""
    for n in NAMESPACE_NGRAMS:
        if n <= longer_than or len(query) < n:
            continue
        found: list[int] = []
        for ns, tokens in added:
            if ns != namespace:
                continue
            for cont in range(n, len(tokens)):
                if tokens[cont - n : cont] == query[-n:]:
                    found = tokens[cont : cont + min(max_tokens, MAX_TOKENS)]
        if found:
            return found, n
    return [], 0


class NamespaceIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.full = NamespaceIndex(MAX_TOKENS, capacity=1 << 20)
        self.small = NamespaceIndex(MAX_TOKENS, capacity=SMALL)
        self.added: list[tuple[str | None, list[int]]] = []

    @rule(namespace=namespace_st, tokens=st.lists(token_st, min_size=0, max_size=12))
    def add(self, namespace: str | None, tokens: list[int]) -> None:
        self.full.add(namespace, tokens)
        self.small.add(namespace, tokens)
        self.added.append((namespace, tokens))

    @rule(namespace=namespace_st, query=st.lists(token_st, min_size=0, max_size=6),
          max_tokens=st.integers(1, 8), longer_than=st.integers(0, 4))
    def lookup(self, namespace: str | None, query: list[int], max_tokens: int,
               longer_than: int) -> None:
        expected = scan(self.added, namespace, query, max_tokens, longer_than)
        assert self.full.lookup(namespace, query, max_tokens, longer_than) == expected
        draft, n = self.small.lookup(namespace, query, max_tokens, longer_than)
        if draft:
            assert n > longer_than
            assert any(ns == namespace and tokens[cont - n : cont] == query[-n:]
                       and tokens[cont : cont + len(draft)] == draft
                       for ns, tokens in self.added for cont in range(n, len(tokens)))
        else:
            assert n == 0

    @invariant()
    def bounded(self) -> None:
        assert len(self.small) <= SMALL


NamespaceIndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30,
                                                   deadline=None)
test_namespace_index_state_machine = NamespaceIndexMachine.TestCase
