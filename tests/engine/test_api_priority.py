"""Priority through the Python API, as vLLM has it: off unless the engine is built with
``scheduling_policy="priority"`` (a non-zero priority is then a ValueError naming it, raised
in the caller's thread before anything is queued); on, it orders admission and never changes
a greedy answer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_helpers import greedy

from engine import Engine, EngineConfig


def test_a_priority_is_refused_unless_the_engine_schedules_by_priority(engine: Engine) -> None:
    assert engine.config.scheduler.scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match=r"^params\.priority: .*scheduling_policy"):
        engine.generate("Hello", greedy(4, priority=-1000))
    with pytest.raises(ValueError, match=r"^params\[1\]\.priority: "):
        engine.generate(["Hello", "Hi"], [greedy(4), greedy(4, priority=1)])
    with pytest.raises(ValueError, match=r"^params\.priority: "):
        engine.submit("Hello", greedy(4, priority=3))
    assert engine.num_waiting() == 0  # nothing was queued
    [out] = engine.generate("Hello", greedy(4, priority=0))
    assert out.token_ids


def test_with_priority_scheduling_a_priority_orders_but_never_changes_an_answer(
    engine: Engine, make_engine: Callable[..., Engine]
) -> None:
    prioritised = make_engine(page_size=16, num_pages=256, scheduling_policy="priority")
    prompts = ["The capital of France is", "One, two, three,"]
    want = [o.token_ids for o in engine.generate(prompts, greedy(6))]
    got = prioritised.generate(prompts, [greedy(6, priority=-1000), greedy(6, priority=1000)])
    assert [o.token_ids for o in got] == want


def test_the_scheduling_policy_and_aging_are_checked_knobs() -> None:
    config = EngineConfig.make(scheduling_policy="priority", priority_aging_seconds=0.5)
    assert config.scheduler.scheduling_policy == "priority"
    assert config.scheduler.priority_aging_seconds == 0.5
    with pytest.raises(ValueError, match="scheduling_policy: must be one of fcfs, priority"):
        EngineConfig.make(scheduling_policy="lpm")
    for bad in (-1.0, float("nan"), 1e9, "1"):
        with pytest.raises(ValueError, match=r"priority_aging_seconds: .*\[0, 3600\]"):
            EngineConfig.make(priority_aging_seconds=bad)
