"""The one token-level generator: the simulators' sessions and the tree bench's requests."""

from __future__ import annotations

import pytest

from workloads.traces.synthetic import TRACES, multi_turn_chat, rag, shared_prefix, unique
from workloads.tree_bench.requests import replay_requests

SMALL = {
    "shared-prefix": lambda **kw: shared_prefix(groups=3, per_group=2, prefix=40, **kw),
    "multi-turn": lambda **kw: multi_turn_chat(conversations=3, turns=3, system=30, **kw),
    "rag": lambda **kw: rag(documents=5, doc_tokens=50, requests=8, **kw),
    "unique": lambda **kw: unique(requests=4, prompt=30, **kw),
}


def _shape(trace) -> list:
    return [(len(s.prefix), [(len(t.user), t.max_new_tokens) for t in s.turns], s.arrival)
            for s in trace.sessions]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_replies_add_the_reply_tokens_and_keep_the_shape(name: str) -> None:
    plain, with_replies = SMALL[name](), SMALL[name](replies=True)
    assert _shape(plain) == _shape(with_replies)
    assert all(t.reply is None for s in plain.sessions for t in s.turns)
    assert all(len(t.reply) == t.max_new_tokens for s in with_replies.sessions for t in s.turns)
    assert SMALL[name](replies=True) == with_replies  # seeded


def test_a_replayed_turn_carries_every_earlier_turn_and_reply_of_its_session() -> None:
    trace = SMALL["multi-turn"](replies=True)
    requests = replay_requests(trace)
    assert len(requests) == trace.num_requests == len(trace.order)
    seen: dict[int, list[int]] = {}
    for s, request in zip(trace.order, requests):
        prompt = request.prompt.tolist()
        before = seen.get(s, trace.sessions[s].prefix)
        assert prompt[: len(before)] == before
        seen[s] = prompt + request.reply.tolist()


def test_a_trace_drawn_without_replies_cannot_be_replayed() -> None:
    with pytest.raises(ValueError, match="replies"):
        replay_requests(TRACES["unique"](requests=2, prompt=8))
