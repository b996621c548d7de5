"""The simulators' scripted model and the requests it makes of a trace.

The "model" samples a token that is a function of the session, the turn and the position, so
every reply, and therefore every closed-loop prompt, is known in advance and identical across
policies, capacities, replicas and routers.
"""

from __future__ import annotations

from workloads.traces.synthetic import VOCAB, SimTrace


def reply_token(session: int, turn: int, index: int) -> int:
    """The simulated model's ``index``-th reply token to a session's turn."""
    return (session * 1_000_003 + turn * 10_007 + index * 7_919 + 12_345) % VOCAB


def reply(session: int, turn: int, length: int) -> list[int]:
    return [reply_token(session, turn, i) for i in range(length)]


def expand(trace: SimTrace) -> list[tuple[int, int, list[int], list[int]]]:
    """Every request as (session, turn, prompt, reply), in submission order (arrival, turn,
    its think time)."""
    out = []
    for s, session in enumerate(trace.sessions):
        history = list(session.prefix)
        due = session.arrival
        for t, turn in enumerate(session.turns):
            due += turn.think + (t > 0)
            prompt = history + turn.user
            answer = reply(s, t, turn.max_new_tokens)
            out.append((due, s, t, prompt, answer))
            history = prompt + answer
    out.sort(key=lambda item: (item[0], item[1], item[2]))
    return [(s, t, prompt, answer) for _, s, t, prompt, answer in out]
