"""The ideal hit rate: what an infinite cache with the same page size could serve.

Each request's prompt is matched against the prompt + output tokens of every earlier request
(in the order they were sent). Only whole pages are cached, so the match is rounded down to a
page boundary, and it is capped at the page-aligned part of ``len(prompt) - 1``: the last
prompt token is always computed, since its logits give the first output token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PageTrie:
    """A trie keyed by whole pages of tokens: an infinite cache, no eviction."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root: dict[tuple[int, ...], dict] = {}

    def match(self, tokens: Sequence[int]) -> int:
        """Tokens of the longest cached page-aligned prefix of ``tokens``."""
        node = self.root
        p = self.page_size
        matched = 0
        while matched + p <= len(tokens):
            child = node.get(tuple(tokens[matched : matched + p]))
            if child is None:
                break
            node = child
            matched += p
        return matched

    def insert(self, tokens: Sequence[int]) -> None:
        node = self.root
        p = self.page_size
        for start in range(0, len(tokens) - p + 1, p):
            node = node.setdefault(tuple(tokens[start : start + p]), {})


def ideal_cached_tokens(
    requests: Iterable[tuple[Sequence[int], Sequence[int]]], page_size: int
) -> list[int]:
    """Per request (prompt ids, output ids), in send order: the tokens an infinite cache serves."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    trie = PageTrie(page_size)
    out = []
    for prompt, output in requests:
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        cap = (len(prompt) - 1) // page_size * page_size
        out.append(min(trie.match(prompt), cap))
        trie.insert(list(prompt) + list(output))
    return out


def ideal_hit_rate(
    requests: Iterable[tuple[Sequence[int], Sequence[int]]], page_size: int
) -> float:
    """Cached / prompt tokens over all requests with an infinite cache (0.0 with no tokens)."""
    requests = list(requests)
    cached = sum(ideal_cached_tokens(requests, page_size))
    total = sum(len(p) for p, _ in requests)
    return cached / total if total else 0.0
