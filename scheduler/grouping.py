"""In-batch grouping: which uncached prefixes prefills in flight are computing right now.

A prefill claims the tokens it will compute, filed under where they start in the tree (the
page id its tree part ends at, or the namespace root) and their first page. A waiting
request whose match ends at the same place and continues with the same tokens for at least
``min_pages`` pages waits: once the claimant's chunk is inserted it hits instead of computing
the same prefix a second time.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Claim:
    tokens: Sequence[int]
    start: int
    end: int  # claimed tokens are tokens[start:end] (whole pages)


class PrefillClaims:
    def __init__(self, page_size: int, min_pages: int) -> None:
        self._page_size = page_size
        self._span = page_size * min_pages
        self._claims: dict[tuple[Hashable, tuple[int, ...]], list[_Claim]] = {}

    def __len__(self) -> int:
        return len(self._claims)

    def claim(self, tokens: Sequence[int], start: int, anchor: Hashable) -> None:
        """``tokens[start:]`` will be computed; ``start`` is where its tree part ends."""
        p = self._page_size
        end = (len(tokens) // p) * p
        if start + self._span > end:
            return  # too short to be worth waiting for
        key = (anchor, tuple(tokens[start : start + p]))
        self._claims.setdefault(key, []).append(_Claim(tokens, start, end))

    def covers(self, tokens: Sequence[int], length: int, cap: int, anchor: Hashable) -> bool:
        """True when a claimant computes at least ``min_pages`` pages of ``tokens[length:cap]``."""
        span = self._span
        if not self._claims or length + span > cap:
            return False
        found = self._claims.get((anchor, tuple(tokens[length : length + self._page_size])))
        if not found:
            return False
        wanted = tokens[length : length + span]
        return any(
            claim.start + span <= claim.end
            and claim.tokens[claim.start : claim.start + span] == wanted
            for claim in found
        )
