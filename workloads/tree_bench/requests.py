"""The tree bench's requests: the token-level traces of ``workloads.traces.synthetic``, drawn
with their replies and replayed request by request (no model, no text).

The simulators run the same shapes closed loop through a scheduler; the tree bench has no
scheduler, so a request is a prompt and a reply, both 1-D int32 numpy arrays (the tree's fast
path), and the replay caches prompt + reply, as an engine does when a request finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from workloads.traces import synthetic
from workloads.traces.synthetic import SimTrace


@dataclass(slots=True)
class TraceRequest:
    prompt: np.ndarray
    reply: np.ndarray


def replay_requests(trace: SimTrace) -> list[TraceRequest]:
    """Every turn of ``trace`` (drawn with ``replies=True``) as a request, in the trace's
    ``order``: a turn's prompt is its session's prefix, every earlier turn and reply, then
    its user tokens."""
    sessions = trace.sessions
    order = trace.order
    if order is None:
        order = [s for s, session in enumerate(sessions) for _ in session.turns]
    history = [list(session.prefix) for session in sessions]
    next_turn = [0] * len(sessions)
    out: list[TraceRequest] = []
    for s in order:
        turn = sessions[s].turns[next_turn[s]]
        next_turn[s] += 1
        if turn.reply is None:
            raise ValueError(f"trace {trace.name!r}: drawn without replies (replies=True)")
        prompt = history[s] + turn.user
        out.append(TraceRequest(np.asarray(prompt, np.int32), np.asarray(turn.reply, np.int32)))
        history[s] = prompt + turn.reply
    return out


def _requests(make: Callable[..., SimTrace]) -> list[TraceRequest]:
    return replay_requests(make(replies=True))


# The shapes the tree bench replays, at the simulators' default sizes.
TRACES: dict[str, Callable[[], list[TraceRequest]]] = {
    name: partial(_requests, synthetic.TRACES[name])
    for name in ("shared-prefix", "multi-turn", "rag", "unique")
}
