"""Token-level synthetic traces (no text, no tokenizer), one generator for every caller.

The cache-only simulators run them closed loop: a session is a prefix (system prompt,
document...) then turns, turn k+1 submitted once turn k has finished and carrying turn k's
actual reply (whatever the simulated model produced); single-request workloads are one-turn
sessions. The radix tree bench (``workloads.tree_bench``) has no model, so it replays the
same shapes drawn with their replies (``replies=True``: each reply's tokens drawn right after
its user turn) in the order the sessions interleave (``SimTrace.order``). The shapes: shared
prefix, multi-turn chat, RAG, unique, open-loop bursts, and for routing across replicas
multi-tenant chat and RAG over a corpus. Everything is deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

VOCAB = 32_000


class SimTurn(msgspec.Struct, frozen=True):
    """A user message (token ids) and the reply length the simulated model generates.

    ``reply``: the reply's tokens when the trace was drawn with them (``replies=True``: a
    replay without a model); the simulators' scripted model writes its own. ``think``: steps
    the user pauses after the previous reply before sending this turn (reading, typing, a
    tool running)."""

    user: list[int]
    max_new_tokens: int
    reply: list[int] | None = None
    think: int = 0


class SimSession(msgspec.Struct, frozen=True):
    """``prefix`` (system prompt, document...) then turns; the first arrives at ``arrival``
    (a simulator step), each later one its ``think`` steps after the previous reply is
    complete."""

    prefix: list[int]
    turns: list[SimTurn]
    arrival: int = 0
    namespace: str | None = None


class SimTrace(msgspec.Struct, frozen=True):
    """Sessions, and for a replay request by request, ``order``: the session of each request
    in turn where sessions interleave (None: session after session)."""

    name: str
    sessions: list[SimSession]
    order: list[int] | None = None

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32).tolist()


def _turn(rng: np.random.Generator, user: int, reply: int, replies: bool) -> SimTurn:
    """``user`` tokens, then (with ``replies``) the ``reply`` tokens, from the same stream."""
    user_tokens = _tokens(rng, user)
    return SimTurn(user_tokens, reply, _tokens(rng, reply) if replies else None)


def shared_prefix(
    seed: int = 0, groups: int = 16, per_group: int = 16, prefix: int = 2000, unique: int = 100,
    reply: int = 32, replies: bool = False,
) -> SimTrace:
    """16 groups x 16 requests: a 2,000-token group prefix + 100 unique tokens, shuffled."""
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix) for _ in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    sessions = [SimSession(prefixes[g], [_turn(rng, unique, reply, replies)]) for g in order]
    return SimTrace("shared-prefix", sessions)


def multi_turn_chat(
    seed: int = 1, conversations: int = 64, turns: int = 8, system: int = 200, user: int = 150,
    reply: int = 100, replies: bool = False,
) -> SimTrace:
    """64 conversations x 8 turns on one 200-token system prompt: +150 user, +100 reply per
    turn, closed loop (turn k+1 carries the reply to turn k). The conversations' turns are
    drawn randomly interleaved, the order a replay sends them in."""
    rng = np.random.default_rng(seed)
    system_tokens = _tokens(rng, system)
    session_turns: list[list[SimTurn]] = [[] for _ in range(conversations)]
    remaining = [turns] * conversations
    order: list[int] = []
    while any(remaining):
        live = [c for c in range(conversations) if remaining[c]]
        c = live[int(rng.integers(len(live)))]
        session_turns[c].append(_turn(rng, user, reply, replies))
        order.append(c)
        remaining[c] -= 1
    sessions = [SimSession(system_tokens, t) for t in session_turns]
    return SimTrace("multi-turn", sessions, order)


def rag(
    seed: int = 2, documents: int = 200, doc_tokens: int = 1000, requests: int = 2000,
    zipf: float = 1.1, system: int = 100, question: int = 50, reply: int = 32,
    replies: bool = False,
) -> SimTrace:
    """system(100) + one of 200 1,000-token documents (Zipf 1.1 popularity) + question(50)."""
    rng = np.random.default_rng(seed)
    system_tokens = _tokens(rng, system)
    docs = [_tokens(rng, doc_tokens) for _ in range(documents)]
    weights = 1.0 / np.arange(1, documents + 1) ** zipf
    picks = rng.choice(documents, size=requests, p=weights / weights.sum())
    sessions = [
        SimSession(system_tokens + docs[d], [_turn(rng, question, reply, replies)])
        for d in picks
    ]
    return SimTrace("rag", sessions)


def unique(
    seed: int = 3, requests: int = 500, prompt: int = 1000, reply: int = 32,
    replies: bool = False,
) -> SimTrace:
    """500 random 1,000-token prompts: nothing to share."""
    rng = np.random.default_rng(seed)
    sessions = [SimSession([], [_turn(rng, prompt, reply, replies)]) for _ in range(requests)]
    return SimTrace("unique", sessions)


def bursts(
    seed: int = 4, bursts: int = 50, per_burst: int = 200, every: int = 40, prefixes: int = 100,
    prefix: int = 500, question: int = 50, reply: int = 16, zipf: float = 1.1,
) -> SimTrace:
    """10,000 requests arriving in 50 bursts of 200, one every 40 steps: a Zipf-popular
    500-token prefix (100 of them) + a 50-token question."""
    rng = np.random.default_rng(seed)
    shared = [_tokens(rng, prefix) for _ in range(prefixes)]
    weights = 1.0 / np.arange(1, prefixes + 1) ** zipf
    sessions = []
    for b in range(bursts):
        picks = rng.choice(prefixes, size=per_burst, p=weights / weights.sum())
        sessions.extend(
            SimSession(shared[k], [SimTurn(_tokens(rng, question), reply)], arrival=b * every)
            for k in picks
        )
    return SimTrace("bursts", sessions)


TRACES: dict[str, Callable[[], SimTrace]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn_chat,
    "rag": rag,
    "unique": unique,
    "bursts": bursts,
}


# --------------------------------------------------------------------- cluster traces
# Thousands of sessions arriving over time, for routing across replicas
# (``workloads.simulate --replicas``). Kept apart from TRACES so the single-engine table
# stays quick.


def _zipf_picks(rng: np.random.Generator, n: int, size: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return rng.choice(n, size=size, p=weights / weights.sum())


def _arrivals(rng: np.random.Generator, size: int, spacing: float) -> list[int]:
    """Poisson arrivals: ``size`` steps with exponential gaps of mean ``spacing``."""
    return np.floor(np.cumsum(rng.exponential(spacing, size=size))).astype(int).tolist()


def tenants(
    seed: int = 5, prompts: int = 200, sessions: int = 3000, system: tuple[int, int] = (150, 450),
    turns: tuple[int, int] = (1, 4), user: tuple[int, int] = (10, 60),
    reply: tuple[int, int] = (8, 40), zipf: float = 1.0, namespaces: int = 4,
    namespaced: float = 0.2, spacing: float = 1.0,
) -> SimTrace:
    """Multi-tenant chat: 3,000 sessions of 1-4 short turns, each on one of 200 system prompts
    (150-450 tokens, Zipf 1.0 popularity), one arriving every ``spacing`` steps on average so
    that many overlap. A fifth of the sessions belong to one of 4 namespaced tenants, who
    draw from the same prompts: the same prompt in two namespaces shares nothing."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(system[0], system[1] + 1, size=prompts)
    shared = [_tokens(rng, int(n)) for n in lengths]
    picks = _zipf_picks(rng, prompts, sessions, zipf)
    arrivals = _arrivals(rng, sessions, spacing)
    out = []
    for k, arrival in zip(picks, arrivals):
        namespace = None
        if rng.random() < namespaced:
            namespace = f"tenant-{int(rng.integers(namespaces))}"
        session_turns = [
            SimTurn(_tokens(rng, int(rng.integers(user[0], user[1] + 1))),
                    int(rng.integers(reply[0], reply[1] + 1)))
            for _ in range(int(rng.integers(turns[0], turns[1] + 1)))
        ]
        out.append(SimSession(shared[k], session_turns, arrival, namespace))
    return SimTrace("tenants", out)


def rag_corpus(
    seed: int = 6, documents: int = 400, doc_tokens: tuple[int, int] = (300, 900),
    queries: int = 3000, zipf: float = 1.0, system: int = 64, question: tuple[int, int] = (16, 64),
    reply: tuple[int, int] = (8, 32), spacing: float = 0.5,
) -> SimTrace:
    """RAG over a corpus: 3,000 one-turn queries, each a 64-token system prompt, one of 400
    documents (300-900 tokens, Zipf 1.0 popularity) and a short question, two arriving per
    step on average."""
    rng = np.random.default_rng(seed)
    system_tokens = _tokens(rng, system)
    lengths = rng.integers(doc_tokens[0], doc_tokens[1] + 1, size=documents)
    docs = [_tokens(rng, int(n)) for n in lengths]
    picks = _zipf_picks(rng, documents, queries, zipf)
    arrivals = _arrivals(rng, queries, spacing)
    sessions = [
        SimSession(
            system_tokens + docs[d],
            [SimTurn(_tokens(rng, int(rng.integers(question[0], question[1] + 1))),
                     int(rng.integers(reply[0], reply[1] + 1)))],
            arrival,
        )
        for d, arrival in zip(picks, arrivals)
    ]
    return SimTrace("rag_corpus", sessions)


def think_chat(
    seed: int = 7, conversations: int = 600, prompts: int = 8, system: tuple[int, int] = (100, 300),
    turns: tuple[int, int] = (3, 8), user: tuple[int, int] = (20, 120),
    reply: tuple[int, int] = (20, 100), think: float = 300.0, spacing: float = 4.0,
) -> SimTrace:
    """Conversations that pause: 600 chats of 3-8 turns on 8 system prompts (100-300 tokens,
    Zipf 1.0), 20-120 user and 20-100 reply tokens a turn, the user thinking ~300 steps
    (exponential) between a reply and the next turn, one chat arriving every ~4 steps. Many
    more chats are alive than their pages fit in a pool: between two turns other chats push a
    chat's pages out (to host memory or disk, with tiers), and its next turn repeats them."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(system[0], system[1] + 1, size=prompts)
    shared = [_tokens(rng, int(n)) for n in lengths]
    picks = _zipf_picks(rng, prompts, conversations, 1.0)
    arrivals = _arrivals(rng, conversations, spacing)
    out = []
    for k, arrival in zip(picks, arrivals):
        session_turns = [
            SimTurn(
                _tokens(rng, int(rng.integers(user[0], user[1] + 1))),
                int(rng.integers(reply[0], reply[1] + 1)),
                think=int(rng.exponential(think)) if i else 0,
            )
            for i in range(int(rng.integers(turns[0], turns[1] + 1)))
        ]
        out.append(SimSession(shared[k], session_turns, arrival))
    return SimTrace("think_chat", out)


CLUSTER_TRACES: dict[str, Callable[[], SimTrace]] = {
    "tenants": tenants,
    "rag_corpus": rag_corpus,
    "think_chat": think_chat,
}
