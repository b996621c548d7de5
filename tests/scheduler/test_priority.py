"""Priority (vLLM's meaning: lower runs first): admission by priority, then the policy's own
order; preemption takes the worst priority first; a low priority waits, but not forever."""

from __future__ import annotations

import pytest
from scheduler_harness import ScriptedModel, make_scheduler

from scheduler import Request, SamplingParams, Scheduler

POLICIES = ["fcfs", "lpm", "dfs-weight"]


def _request(rid: int, priority: int, tokens: int = 40, new: int = 4) -> Request:
    prompt = [1000 + 7 * rid + i for i in range(tokens)]
    return Request(rid, prompt, SamplingParams(max_new_tokens=new, priority=priority))


def _admitted_order(sched: Scheduler, model: ScriptedModel, steps: int) -> list[object]:
    order: list[object] = []
    for _ in range(steps):
        batch = sched.schedule()
        if batch is None:
            break
        for entry in batch.entries:
            if entry.request.id not in order:
                order.append(entry.request.id)
        sched.commit(batch, model.step(batch))
        sched.check_integrity()
    return order


@pytest.mark.parametrize("policy", POLICIES)
def test_better_priorities_are_admitted_first_then_arrival(policy: str) -> None:
    sched, model, _, _ = make_scheduler(
        200, 16, max_batch_tokens=64, max_running=1, policy=policy
    )
    for rid, priority in enumerate([5, 0, 5, -3, 0]):
        sched.add(_request(rid, priority))
    assert _admitted_order(sched, model, 200) == [3, 1, 4, 0, 2]


def test_priority_must_be_an_integer_in_range() -> None:
    for bad in (1.5, True, "1", 1 << 31):
        with pytest.raises(ValueError, match="priority"):
            SamplingParams(priority=bad)  # type: ignore[arg-type]
    assert SamplingParams(priority=-(1 << 31)).priority == -(1 << 31)


def test_preemption_takes_the_worst_priority_first() -> None:
    """Two requests that cannot both finish in 6 pages of 4 tokens (no decode reserve, so both
    are admitted): the better one, admitted last (the newest, whom the rule without
    priorities would preempt), keeps running."""
    sched, model, _, _ = make_scheduler(
        6, 4, max_batch_tokens=64, max_running=4,
        reserve_ratio_init=0.0, reserve_ratio_min=0.0, reserve_margin=0.0,
    )
    low = _request(0, priority=9, tokens=8, new=8)
    high = _request(1, priority=1, tokens=8, new=8)
    sched.add(low)
    batch = sched.schedule()
    assert batch is not None
    sched.commit(batch, model.step(batch))  # low runs first
    sched.add(high)
    for _ in range(60):
        batch = sched.schedule()
        if batch is None:
            break
        sched.commit(batch, model.step(batch))
        sched.check_integrity()
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert low.is_done and high.is_done


def test_a_low_priority_request_waits_but_is_not_starved() -> None:
    """A stream of priority-0 requests that always fills the one running slot: the priority-5
    request gets in once its level has aged past theirs (5 x aging_steps, plus their age)."""
    aging = 8
    sched, model, _, _ = make_scheduler(
        400, 16, max_batch_tokens=64, max_running=1, priority_aging_steps=aging
    )
    low = _request(0, priority=5)
    sched.add(low)
    next_id = 1
    admitted_at = None
    for step in range(400):
        while sched.num_waiting < 3:  # better work always waiting
            sched.add(_request(next_id, priority=0))
            next_id += 1
        batch = sched.schedule()
        assert batch is not None
        if any(e.request is low for e in batch.entries):
            admitted_at = step
            break
        sched.commit(batch, model.step(batch))
    assert admitted_at is not None, "the low-priority request starved"
    assert admitted_at >= 5 * aging  # it did wait behind the better traffic


def test_without_aging_a_low_priority_waits_for_the_better_traffic() -> None:
    sched, model, _, _ = make_scheduler(
        400, 16, max_batch_tokens=64, max_running=1, priority_aging_steps=0
    )
    low = _request(0, priority=5)
    sched.add(low)
    for rid in range(1, 40):
        while sched.num_waiting < 3:
            sched.add(_request(100 + rid * 10 + sched.num_waiting, priority=0))
        batch = sched.schedule()
        assert batch is not None and all(e.request is not low for e in batch.entries)
        sched.commit(batch, model.step(batch))
