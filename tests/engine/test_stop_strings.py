"""The stop-string automaton against a naive reference: the first stop string to end in the
text (the longest of those ending at one character), and the text to hold back, whatever the
strings and however the text is cut into pieces (tokens, accepted drafts)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.serving.detokenizer import IncrementalDetokenizer
from engine.serving.stop_strings import StopAutomaton, stop_automaton

# A small alphabet makes overlaps, shared prefixes and strings inside strings common.
stop_lists = st.lists(st.text("abc ", min_size=1, max_size=6), min_size=1, max_size=12)
texts = st.text("abc d", max_size=60)


def first_stop(text: str, stops: list[str], report_from: int = 0) -> tuple[int, int]:
    """(index just past the first stop string ending at ``report_from`` or later, its
    length), (-1, 0) when none: every end position, every string."""
    for end in range(report_from + 1, len(text) + 1):
        found = [s for s in stops if text[:end].endswith(s)]
        if found:
            return end, max(map(len, found))
    return -1, 0


def held(text: str, stops: list[str]) -> int:
    """The longest tail of ``text`` that is a prefix of a stop string."""
    return max((k for k in range(len(text) + 1) if any(s.startswith(text[len(text) - k :])
                                                       for s in stops)), default=0)


def pieces(text: str, cuts: list[int]) -> list[str]:
    at = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(at, at[1:])]


@settings(max_examples=300, deadline=None)
@given(stops=stop_lists, text=texts, cuts=st.lists(st.integers(0, 60), max_size=8),
       report_from=st.integers(0, 20))
def test_the_automaton_finds_what_the_naive_search_finds_however_the_text_is_cut(
    stops: list[str], text: str, cuts: list[int], report_from: int
) -> None:
    automaton = StopAutomaton(stops)
    want_end, want_len = first_stop(text, stops, report_from)
    state, read = 0, 0
    for piece in pieces(text, cuts):
        state, end, length = automaton.feed(state, piece, report_from - read)
        if end >= 0:
            assert (read + end, length) == (want_end, want_len)
            return
        read += len(piece)
        assert automaton.held(state) == held(text[:read], stops)
    assert want_end == -1


def test_many_stop_strings_share_one_cached_automaton() -> None:
    stops = [f"zq{i}xw" for i in range(5000)]
    automaton = stop_automaton(stops)
    assert stop_automaton(list(stops)) is automaton
    state, end, length = automaton.feed(0, "hello zq4999x")
    assert end == -1 and automaton.held(state) == len("zq4999x")
    assert automaton.feed(state, "w and more") == (automaton.feed(state, "w")[0], 1, 8)


class PieceTokenizer:
    """Token ``i`` is ``pieces[i]``: a test chooses exactly where the text is cut."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(self.pieces[i] for i in ids)


@settings(max_examples=200, deadline=None)
@given(stops=stop_lists, text=texts, cuts=st.lists(st.integers(0, 60), max_size=12),
       include=st.booleans())
def test_a_reply_stops_at_the_first_stop_string_to_end_however_its_tokens_cut_it(
    stops: list[str], text: str, cuts: list[int], include: bool
) -> None:
    """Where a reply stops is a property of its text: a token (or an accepted draft) that
    brings "abcd" stops at "bc" before "abcd", as one character at a time would."""
    tokens = pieces(text, cuts)
    detok = IncrementalDetokenizer(PieceTokenizer(tokens), stop=stops, include_stop=include)
    shown = "".join(detok.push(i) for i in range(len(tokens))) + detok.finish()
    end, length = first_stop(text, stops)
    if end < 0:
        assert not detok.stopped and shown == text
    else:
        assert detok.stopped and detok.stop_string == text[end - length : end]
        assert shown == text[: end if include else end - length]
    assert shown == detok.text
    assert include or not any(stop in shown for stop in stops)


def test_a_token_holding_two_stop_strings_stops_at_the_one_that_ends_first() -> None:
    detok = IncrementalDetokenizer(PieceTokenizer(["x", "abcd"]), stop=["abcd", "bc"])
    assert detok.push(0) + detok.push(1) + detok.finish() == "xa"
    assert detok.stop_string == "bc"
