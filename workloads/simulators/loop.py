"""The simulators' one loop: a trace's sessions, closed loop, through N schedulers.

One engine is N = 1 with nothing to choose; a cluster passes ``place`` (its router) and
``start_step``, called with the step's number before anything is placed (the router's clock;
the replicas' KV events reaching the router's index). Each step: the requests due now are
placed, later turns first (in the order their previous turn finished: the step before, or
their ``think`` steps earlier), then the first turns of sessions arriving now, each
scheduler's load counted as its waiting + running requests; then every scheduler runs one step, its sampled tokens written by the
scripted model (``script.reply_token``). When nothing ran and no scheduler has work left,
the clock jumps to the next arrival (work left that nothing runs is an error).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from scheduler import Request, SamplingParams, Scheduler
from workloads.simulators.script import reply_token
from workloads.traces.synthetic import SimTrace

# (prompt, namespace, each scheduler's load, turn) -> the name of the scheduler to run it on
Place = Callable[[list[int], str | None, dict[str, int], int], str]


@dataclass
class TurnCounts:
    """Prompt tokens of some requests and how they were served (at first admission)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # from the pool or loaded from below it
    cached_below: int = 0  # of them, loaded from host memory or disk

    def add(self, request: Request) -> None:
        self.requests += 1
        self.prompt_tokens += len(request.prompt)
        self.cached_tokens += request.cached_tokens
        self.cached_below += request.cached_tokens_below

    @property
    def pool_hit_rate(self) -> float:
        pool = self.cached_tokens - self.cached_below
        return pool / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def below_hit_rate(self) -> float:
        return self.cached_below / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class LoopResult:
    steps: int  # the makespan: steps until the last request finished
    decode_tokens: int
    placed: dict[str, int]  # requests sent to each scheduler
    later_turns: TurnCounts  # every turn after a session's first


def run_closed_loop(
    trace: SimTrace,
    schedulers: Mapping[str, Scheduler],
    place: Place | None = None,
    start_step: Callable[[int], None] | None = None,
) -> LoopResult:
    """Run every session of ``trace`` to completion; ``place`` is needed for N > 1."""
    if place is None and len(schedulers) != 1:
        raise ValueError(f"place: needed to choose among {len(schedulers)} schedulers")
    only = next(iter(schedulers))
    sessions = trace.sessions
    arrivals = [(session.arrival, s) for s, session in enumerate(sessions)]
    heapq.heapify(arrivals)
    # turns to place once due: (step, order finished, session, turn, history)
    follow: list[tuple[int, int, int, int, list[int]]] = []
    finished = 0
    later = TurnCounts()
    turn_of: dict[int, tuple[int, int]] = {}  # request id -> (session, turn)
    placed = dict.fromkeys(schedulers, 0)
    scheds = list(schedulers.values())

    def submit(s: int, t: int, history: list[int], loads: dict[str, int]) -> None:
        session = sessions[s]
        turn = session.turns[t]
        prompt = history + turn.user
        name = only
        if place is not None:
            name = place(prompt, session.namespace, loads, t)
            loads[name] += 1
        placed[name] += 1
        request_id = len(turn_of)
        turn_of[request_id] = (s, t)
        params = SamplingParams(max_new_tokens=turn.max_new_tokens)
        schedulers[name].add(Request(request_id, prompt, params, session.namespace))

    step = 0
    decode_tokens = 0
    while arrivals or follow or any(sched.has_work for sched in scheds):
        if start_step is not None:
            start_step(step)
        if (follow and follow[0][0] <= step) or (arrivals and arrivals[0][0] <= step):
            loads: dict[str, int] = {}  # read by ``place`` only
            if place is not None:
                loads = {n: sched.num_waiting + sched.num_running for n, sched in schedulers.items()}
            while follow and follow[0][0] <= step:
                _, _, s, t, history = heapq.heappop(follow)
                submit(s, t, history, loads)
            while arrivals and arrivals[0][0] <= step:
                _, s = heapq.heappop(arrivals)
                submit(s, 0, list(sessions[s].prefix), loads)
        ran = False
        for sched in scheds:
            batch = sched.schedule()
            if batch is None:
                continue
            ran = True
            tokens = []
            for entry in batch.entries:
                if entry.sample:
                    s, t = turn_of[entry.request.id]
                    tokens.append(reply_token(s, t, len(entry.request.output)))
                else:
                    tokens.append(-1)
            decode_tokens += batch.num_decode
            for request in sched.commit(batch, tokens):
                s, t = turn_of[request.id]
                if t:
                    later.add(request)
                if t + 1 < len(sessions[s].turns):
                    due = step + 1 + sessions[s].turns[t + 1].think
                    finished += 1
                    heapq.heappush(
                        follow, (due, finished, s, t + 1, request.prompt + request.output)
                    )
        if not ran:
            if any(sched.has_work for sched in scheds):
                raise RuntimeError("simulator: work left but nothing scheduled")
            due = [arrivals[0][0]] if arrivals else []
            due += [follow[0][0]] if follow else []
            if due:
                step = max(step + 1, min(due))
                continue
        step += 1
    return LoopResult(step, decode_tokens, placed, later)
