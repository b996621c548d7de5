"""Each token's text and exact bytes, as OpenAI's log-probability entries report them.

Byte-level BPE vocabularies (GPT-2's scheme, SmolLM2's) spell every byte as one printable
character; reversing that table gives a token's exact bytes, also for a token that holds
half of a UTF-8 character (its text is then shown with U+FFFD, its bytes stay exact).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE: printable Latin-1 bytes stand for themselves, the
    other 68 bytes are shifted to code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class TokenTexts:
    """Token id -> (text, bytes), cached: the same tokens recur in every response."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._alphabet = _byte_level_alphabet()
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", b""
        if token_id not in self._special and all(c in self._alphabet for c in piece):
            raw = bytes(self._alphabet[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), raw
        text = self._tokenizer.decode([token_id])
        return text, text.encode("utf-8")

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return list(self.lookup(token_id)[1])
