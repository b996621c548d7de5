"""Text cut to a size in tokens of the real tokenizer, drawn from the docstring corpus."""

from __future__ import annotations

import random

from workloads.traces.corpus import Corpus
from workloads.traces.tokenizer import TextTokenizer


def encode(tokenizer: TextTokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def fit_tokens(tokenizer: TextTokenizer, text: str, num_tokens: int) -> str:
    """The longest head of ``text`` that encodes to at most ``num_tokens`` tokens.

    Cutting the ids and decoding can re-encode to a different count (merges across the cut), so
    the cut is refined until it is stable; the result is almost always exactly ``num_tokens``
    long when ``text`` is long enough.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    ids = encode(tokenizer, text)
    if len(ids) <= num_tokens:
        return text
    best = ""
    best_size = 0
    cut = num_tokens
    for _ in range(8):
        out = tokenizer.decode(ids[:cut])
        size = len(encode(tokenizer, out))
        if size == num_tokens:
            return out
        if best_size < size < num_tokens:
            best, best_size = out, size
        cut = max(1, cut + num_tokens - size)
    return best


class TextSource:
    """The corpus seen through a tokenizer: windows of N tokens, messages of N tokens."""

    def __init__(self, tokenizer: TextTokenizer, corpus: Corpus | None = None) -> None:
        self.tokenizer = tokenizer
        self.corpus = corpus if corpus is not None else Corpus()
        self._ids: list[int] | None = None

    @property
    def ids(self) -> list[int]:
        """The whole corpus as token ids (computed once)."""
        if self._ids is None:
            self._ids = encode(self.tokenizer, self.corpus.text())
        return self._ids

    def fit(self, text: str, num_tokens: int) -> str:
        return fit_tokens(self.tokenizer, text, num_tokens)

    def count(self, text: str) -> int:
        return len(encode(self.tokenizer, text))

    def windows(self, sizes: list[int], rng: random.Random, field: str) -> list[str]:
        """Non-overlapping corpus windows of the given sizes in tokens, from a random start.

        Raises ValueError naming ``field`` when the corpus is too small for all of them.
        """
        total = sum(sizes)
        if total > len(self.ids):
            raise ValueError(
                f"{field}: needs {total} tokens of distinct text, the corpus has {len(self.ids)}"
            )
        start = rng.randrange(len(self.ids))
        ids = self.ids[start:] + self.ids[:start]
        out = []
        pos = 0
        for size in sizes:
            out.append(self.fit(self.tokenizer.decode(ids[pos : pos + size + 8]), size))
            pos += size
        return out

    def paragraphs_text(self, num_tokens: int, rng: random.Random) -> str:
        """Consecutive paragraphs from a random place, cut to ``num_tokens`` tokens."""
        paragraphs = self.corpus.paragraphs
        start = rng.randrange(len(paragraphs))
        parts: list[str] = []
        size = 0
        i = start
        while size < num_tokens + 16:
            text = paragraphs[i % len(paragraphs)]
            parts.append(text)
            size += self.count(text) + 1
            i += 1
            if i - start > len(paragraphs):
                break
        return self.fit("\n".join(parts), num_tokens)
