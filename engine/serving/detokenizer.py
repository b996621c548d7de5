"""Incremental detokenisation with stop strings.

Decoding one token at a time is wrong in two ways: a multi-byte UTF-8 character may be split
across tokens (byte-level BPE), and some tokens only decode correctly next to their neighbours
(SentencePiece drops the leading space of a sequence's first word piece). So each step decodes a
short window that starts one step back, and emits only the part of the window's text that is
new; text that ends in an incomplete character is held until the character is complete.

Stop strings are matched on the decoded text, by one automaton over all of them
(``stop_strings.StopAutomaton``: each character read once, whatever their number). Text that
could still turn into a stop string is held back, so a stream never shows a stop string, nor a
piece of one that later completes. The reply stops at the first stop string to end in it (the
longest of those ending at one character), however its text was cut into tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.serving.stop_strings import stop_automaton

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, so a byte-level tokenizer never needs more than 4
# tokens to complete one; past that, a trailing replacement character is real and is emitted.
_MAX_PENDING_TOKENS = 4
# Prompt tokens used as left context for the first generated tokens.
_PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; stops at the first stop string.

    ``push(token_id)`` returns the new visible text (possibly ""). ``finish()`` flushes what
    was held back. ``text`` is everything visible so far; once ``stopped`` is True the text is
    final (it ends just before the stop string, or just after it with ``include_stop``) and
    further tokens are ignored.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._include_stop = include_stop  # the text ends after the stop string, not before
        # Stop strings count only where they end after the text of the first ``min_tokens``
        # tokens (vLLM's min_tokens): ``_stops_after`` characters of it, once known.
        self._min_tokens = min_tokens
        self._pushed = 0
        self._stops_after = 0
        self._skip_special = skip_special_tokens
        self._stops = stop_automaton(stop) if any(stop) else None
        self._state = 0  # the automaton's, after every character of _raw
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        # Window: ids[_anchor:] is decoded each step; ids[_anchor:_read] was decoded (and its
        # new text emitted) in earlier steps and spans _anchor_chars characters.
        self._ids: list[int] = context
        self._anchor = 0
        self._read = len(context)
        self._anchor_chars = len(self._decode(context))
        self._raw = ""  # decoded text of every generated token so far (complete characters)
        self._visible = 0  # characters of _raw handed out
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        return self._raw[: self._visible]

    def push(self, token_id: int) -> str:
        """Adds one generated token; returns the newly visible text."""
        if self.stopped:
            return ""
        self._pushed += 1
        self._ids.append(token_id)
        window = self._decode(self._ids[self._anchor :])
        pending = len(self._ids) - self._read
        if window.endswith(REPLACEMENT_CHAR) and pending < _MAX_PENDING_TOKENS:
            return ""  # an incomplete multi-byte character: wait for its remaining bytes
        return self._append(self._advance(window))

    def finish(self) -> str:
        """Flushes held-back text at the end of the request; returns it."""
        if self.stopped:
            return ""
        delta = ""
        if self._read < len(self._ids):
            window = self._decode(self._ids[self._anchor :])
            delta = self._append(self._advance(window))
        return delta + self._take(len(self._raw))

    def _advance(self, window: str) -> str:
        piece = window[self._anchor_chars :]
        self._anchor, self._read = self._read, len(self._ids)
        self._anchor_chars = len(self._decode(self._ids[self._anchor : self._read]))
        # Keep the id list short: only the window is ever decoded again.
        if self._anchor > 64:
            del self._ids[: self._anchor]
            self._read -= self._anchor
            self._anchor = 0
        return piece

    def _append(self, piece: str) -> str:
        start = len(self._raw)
        self._raw += piece
        if self._stops is None:
            return self._take(len(self._raw))
        if self._pushed <= self._min_tokens:
            self._stops_after = len(self._raw)
        # A stop string counts where it ends past the first _stops_after characters.
        self._state, end, length = self._stops.feed(
            self._state, piece, self._stops_after - start
        )
        if end < 0:
            return self._take(len(self._raw) - self._stops.held(self._state))
        hit = start + end - length
        self.stop_string = self._raw[hit : start + end]
        if self._include_stop:
            hit += length
        self._raw = self._raw[:hit]
        self.stopped = True
        return self._take(hit)

    def _take(self, upto: int) -> str:
        upto = max(upto, self._visible)
        delta = self._raw[self._visible : upto]
        self._visible = upto
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(
            list(ids),
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,
        )
