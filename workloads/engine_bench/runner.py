"""Run a trace through an Engine: every session is a closed loop, all sessions at once.

Sessions start at their arrival time; each turn is sent when the previous reply is back (plus
the turn's think time), together with its branches. The engine batches whatever is in flight.
Prompts are built as token ids here (see workloads.traces.prompts), so the recorded ids are exactly
what the engine saw, and the ideal hit rate can be computed from them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec

from workloads.traces.prompts import SessionPrompts
from workloads.traces.tokenizer import TextTokenizer
from workloads.traces.trace import Session, Trace


class RequestRecord(msgspec.Struct):
    """One request as sent and answered. ``branch`` is -1 for a turn, else the branch index."""

    session: str
    turn: int
    branch: int
    sent_s: float  # seconds since the run started
    prompt_ids: list[int]
    output_ids: list[int]
    cached_tokens: int
    finish_reason: str
    ttft_s: float | None
    latency_s: float


class RunResult(msgspec.Struct):
    """Records in send order, the wall time, and the engine's counters over the run."""

    records: list[RequestRecord]
    wall_s: float
    counters: dict[str, int]


COUNTERS = ("prompt_tokens", "cached_tokens", "cached_tokens_host", "cached_tokens_disk",
            "computed_prefill_tokens", "generated_tokens", "evicted_pages", "preemptions",
            "requests", "aborted")


def _counters(engine: Any) -> dict[str, int]:
    stats = engine.stats()
    return {name: int(getattr(stats.counters, name)) for name in COUNTERS}


async def _run_session(engine: Any, trace: Trace, session: Session, tokenizer: TextTokenizer,
                       started: float, records: list[RequestRecord | None],
                       on_done: Callable[[int], None]) -> None:
    from engine import SamplingParams

    await asyncio.sleep(max(0.0, started + session.arrival_s - time.perf_counter()))
    prompts = SessionPrompts(session, trace, tokenizer)
    for index, turn in enumerate(session.turns):
        if turn.think_s:
            await asyncio.sleep(turn.think_s)
        prompt = prompts.prompt()
        batch = [prompt, *prompts.branch_prompts(prompt)]
        params = SamplingParams(max_new_tokens=turn.max_new_tokens, temperature=0.0,
                                ignore_eos=turn.ignore_eos)
        sent = time.perf_counter() - started
        slots = list(range(len(records), len(records) + len(batch)))
        records.extend([None] * len(batch))  # reserve slots: records stay in send order
        outputs = await engine.agenerate(batch, params)
        for branch, (slot, ids, out) in enumerate(zip(slots, batch, outputs)):
            records[slot] = RequestRecord(
                session.id, index, branch - 1, sent, ids, list(out.token_ids),
                out.cached_tokens, out.finish_reason, out.ttft_s, out.latency_s,
            )
        on_done(len(batch))
        prompts.record_reply(prompt, outputs[0].token_ids, outputs[0].text)


async def run_trace_async(engine: Any, trace: Trace, tokenizer: TextTokenizer,
                          on_done: Callable[[int], None] | None = None) -> RunResult:
    """Send every session of ``trace`` to ``engine``; returns when all replies are back."""
    records: list[RequestRecord | None] = []
    before = _counters(engine)
    started = time.perf_counter()
    await asyncio.gather(*(
        _run_session(engine, trace, s, tokenizer, started, records, on_done or (lambda n: None))
        for s in trace.sessions
    ))
    wall = time.perf_counter() - started
    engine.wait_idle(60.0)  # the last finished requests' pages are back in the tree
    after = _counters(engine)
    done = [r for r in records if r is not None]
    return RunResult(done, wall, {k: after[k] - before[k] for k in COUNTERS})


def run_trace(engine: Any, trace: Trace, tokenizer: TextTokenizer,
              on_done: Callable[[int], None] | None = None) -> RunResult:
    """Blocking wrapper of :func:`run_trace_async`."""
    return asyncio.run(run_trace_async(engine, trace, tokenizer, on_done))
