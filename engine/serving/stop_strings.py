"""Stop strings as one Aho-Corasick automaton: text is matched in time linear in its length,
whatever the number of stop strings.

Looping over the strings at every token cost O(strings x longest) per token (what could
still become a stop string was found by testing every tail of the text against every
string): 5,000 stop strings made each token's text cost milliseconds on the loop thread.
The automaton reads each character once; its state is the longest tail of the text that is a
prefix of a stop string (the text to hold back), and whether a stop string ends there.

A reply stops at the first stop string to end in its text, and of those ending at the same
character, the longest (the one that began first): a property of the text alone, not of how
it was cut into tokens or drafts.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

# Automata kept for reuse: the n choices of a request, and a client's repeated requests,
# share their stop strings. Bounded by their nodes (~20 bytes each) as well as their number.
CACHE_SIZE = 32
CACHE_NODES = 4_000_000
_NONE, _BRANCH = -1, -2  # a node's _char: no child; two or more (in _kids)


class StopAutomaton:
    """Aho-Corasick over ``stops``. A state is an int (0: nothing matched); ``feed`` moves
    it over text, ``held(state)`` is how many characters of the text read so far could still
    be the start of a stop string.

    Nodes live in flat arrays (4 bytes a field): a node with one child keeps it in ``_char``
    / ``_child``, and only nodes where strings part (fewer than the strings) get a dict, so a
    request's 1 MB of stop strings costs tens of MB, not a dict per character."""

    def __init__(self, stops: Sequence[str]) -> None:
        char = array("i", [_BRANCH])  # the one child's code point; _NONE; _BRANCH: see _kids
        child = array("i", [0])
        kids: dict[int, dict[str, int]] = {0: {}}
        depth = array("i", [0])
        ends = array("i", [0])  # length of the stop string ending exactly here (0: none)
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self._down(char, child, kids, node, ch)
                if nxt < 0:
                    nxt = len(depth)
                    depth.append(depth[node] + 1)
                    ends.append(0)
                    char.append(_NONE)
                    child.append(0)
                    if char[node] == _NONE:
                        char[node], child[node] = ord(ch), nxt
                    elif char[node] == _BRANCH:
                        kids[node][ch] = nxt
                    else:
                        kids[node] = {chr(char[node]): child[node], ch: nxt}
                        char[node] = _BRANCH
                node = nxt
            ends[node] = len(stop)
        # Breadth first, so a node's failure link (a shorter tail) is done before it.
        fail = array("i", bytes(4 * len(depth)))
        longest = array("i", ends)  # longest stop string that is a tail of this node's string
        queue = array("i", kids[0].values())
        at = 0
        while at < len(queue):
            node = queue[at]
            at += 1
            for ch, sub in self._children(char, child, kids, node):
                link = fail[node]
                target = self._down(char, child, kids, link, ch)
                while target < 0 and link:
                    link = fail[link]
                    target = self._down(char, child, kids, link, ch)
                fail[sub] = target if target > 0 else 0
                if not longest[sub]:
                    longest[sub] = longest[fail[sub]]
                queue.append(sub)
        self._char, self._child, self._kids = char, child, kids
        self._fail, self._depth, self._longest = fail, depth, longest

    @staticmethod
    def _down(
        char: array, child: array, kids: dict[int, dict[str, int]], node: int, ch: str
    ) -> int:
        """The child of ``node`` by ``ch``, or -1."""
        mark = char[node]
        if mark == _BRANCH:
            return kids[node].get(ch, -1)
        return child[node] if mark == ord(ch) else -1

    @staticmethod
    def _children(
        char: array, child: array, kids: dict[int, dict[str, int]], node: int
    ) -> list[tuple[str, int]]:
        mark = char[node]
        if mark == _BRANCH:
            return list(kids[node].items())
        return [] if mark == _NONE else [(chr(mark), child[node])]

    def feed(self, state: int, text: str, report_from: int = 0) -> tuple[int, int, int]:
        """Reads ``text`` from ``state`` up to the first character, at index ``report_from``
        or later, where a stop string ends. Returns the state after the characters read, the
        index just past that character (-1: none ended, all of ``text`` was read) and the
        length of the longest stop string ending there."""
        char, child, kids = self._char, self._child, self._kids
        fail, longest = self._fail, self._longest
        for i, ch in enumerate(text):
            code = ord(ch)
            while True:
                mark = char[state]
                nxt = kids[state].get(ch, -1) if mark == _BRANCH else (
                    child[state] if mark == code else -1
                )
                if nxt >= 0:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
            if longest[state] and i >= report_from:
                return state, i + 1, longest[state]
        return state, -1, 0

    def held(self, state: int) -> int:
        """Characters at the end of the text read that are a prefix of some stop string."""
        return self._depth[state]

    @property
    def size(self) -> int:
        """Nodes (one per distinct prefix of the stop strings)."""
        return len(self._depth)


_cache: OrderedDict[tuple[str, ...], StopAutomaton] = OrderedDict()
_lock = threading.Lock()


def stop_automaton(stops: Sequence[str]) -> StopAutomaton:
    """The automaton of ``stops`` (empty strings ignored), built once per distinct list."""
    key = tuple(s for s in stops if s)
    with _lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    built = StopAutomaton(key)  # outside the lock: callers' threads build in parallel
    with _lock:
        _cache[key] = built
        while len(_cache) > 1 and (
            len(_cache) > CACHE_SIZE or sum(a.size for a in _cache.values()) > CACHE_NODES
        ):
            _cache.popitem(last=False)
    return built
