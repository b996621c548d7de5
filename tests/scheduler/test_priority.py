"""Priority (vLLM's meaning: lower runs first), on only with ``scheduling_policy="priority"``:
admission by priority, then the policy's own order; preemption takes the worst priority first;
a low priority waits behind better ones for at most its gap x ``priority_aging_seconds`` of
their arrivals, however many steps go by; the queue keeps only the levels that hold requests."""

from __future__ import annotations

import pytest
from scheduler_harness import ScriptedModel, make_scheduler

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.params import PRIORITY_LIMIT
from scheduler.policy import make_queue
from scheduler.priority import PriorityLevels

POLICIES = ["fcfs", "lpm", "dfs-weight"]
PRIORITY = {"scheduling_policy": "priority"}


def _request(
    rid: int, priority: int, tokens: int = 40, new: int = 4, arrived: float | None = None
) -> Request:
    prompt = [1000 + 7 * rid + i for i in range(tokens)]
    request = Request(rid, prompt, SamplingParams(max_new_tokens=new, priority=priority))
    if arrived is not None:
        request.arrival_time = arrived
    return request


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
        200, 16, max_batch_tokens=64, max_running=1, policy=policy, **PRIORITY
    )
    for rid, priority in enumerate([5, 0, 5, -3, 0]):
        sched.add(_request(rid, priority))
    assert _admitted_order(sched, model, 200) == [3, 1, 4, 0, 2]


def test_priority_must_be_an_integer_in_the_documented_range() -> None:
    for bad in (1.5, True, "1", 1 << 31, PRIORITY_LIMIT + 1, -PRIORITY_LIMIT - 1):
        with pytest.raises(ValueError, match=rf"priority: .*\[-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}\]"):
            SamplingParams(priority=bad)  # type: ignore[arg-type]
    assert PRIORITY_LIMIT == 1000
    assert SamplingParams(priority=-PRIORITY_LIMIT).priority == -PRIORITY_LIMIT
    assert SamplingParams(priority=PRIORITY_LIMIT).priority == PRIORITY_LIMIT


def test_without_priority_scheduling_a_priority_is_refused_naming_it() -> None:
    """The default (``scheduling_policy="fcfs"``, vLLM's): a client cannot pick its place."""
    assert SchedulerConfig().scheduling_policy == "fcfs"
    sched, _, _, _ = make_scheduler(200, 16)
    with pytest.raises(ValueError, match="priority: .*scheduling_policy"):
        sched.add(_request(0, priority=-1000))
    sched.add(_request(1, priority=0))  # the default priority is fine
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lottery")


def test_preemption_takes_the_worst_priority_first() -> None:
    """Two requests that cannot both finish in 6 pages of 4 tokens (no decode reserve, so both
    are admitted): the better one, admitted last (the newest, whom the rule without
    priorities would preempt), keeps running."""
    sched, model, _, _ = make_scheduler(
        6, 4, max_batch_tokens=64, max_running=4,
        reserve_ratio_init=0.0, reserve_ratio_min=0.0, reserve_margin=0.0, **PRIORITY,
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


def test_a_flood_of_better_priority_holds_a_request_only_for_its_aging_seconds() -> None:
    """Aging counts seconds waited (from ``arrival_time``), not steps: the priority-5 request
    waits behind priority-0 requests that arrived up to 5 x 1 s after it, and goes before any
    that arrived later, at the first step, however many of them wait."""
    sched, model, _, _ = make_scheduler(
        400, 16, max_batch_tokens=64, max_running=1, priority_aging_seconds=1.0, **PRIORITY
    )
    t0 = 1000.0
    low = _request(0, priority=5, arrived=t0)
    sched.add(low)
    for rid in range(1, 4):  # arrived 4 s after it: ahead of it
        sched.add(_request(rid, priority=0, arrived=t0 + 4.0))
    for rid in range(4, 40):  # a flood arriving 6 s after it: behind it
        sched.add(_request(rid, priority=0, arrived=t0 + 6.0 + rid))
    assert _admitted_order(sched, model, 60)[:4] == [1, 2, 3, 0]


def test_a_flood_cannot_hold_a_waiting_request_past_the_aging_bound_in_wall_time() -> None:
    """Real clock: behind an endless flood at -1000, a priority-0 request is admitted once it
    has waited 1000 x ``priority_aging_seconds`` (here 0.2 s), at whatever step that is."""
    import time

    aging = 0.0002
    sched, model, _, _ = make_scheduler(
        400, 16, max_batch_tokens=64, max_running=1, priority_aging_seconds=aging, **PRIORITY
    )
    low = _request(0, priority=0)
    sched.add(low)
    next_id = 1
    started = time.monotonic()
    while time.monotonic() - started < 30:
        while sched.num_waiting < 4:  # better work always waiting, always newer
            sched.add(_request(next_id, priority=-1000))
            next_id += 1
        batch = sched.schedule()
        assert batch is not None
        if any(e.request is low for e in batch.entries):
            break
        sched.commit(batch, model.step(batch))
        time.sleep(0.002)
    waited = time.monotonic() - low.arrival_time
    assert any(e.request is low for e in batch.entries), "the flood held it for 30 s"
    assert 1000 * aging <= waited < 1000 * aging + 5.0


def test_without_aging_a_low_priority_waits_for_the_better_traffic() -> None:
    sched, model, _, _ = make_scheduler(
        400, 16, max_batch_tokens=64, max_running=1, priority_aging_seconds=0.0, **PRIORITY
    )
    low = _request(0, priority=5, arrived=0.0)  # as old as can be: age does not count
    sched.add(low)
    for rid in range(1, 40):
        while sched.num_waiting < 3:
            sched.add(_request(100 + rid * 10 + sched.num_waiting, priority=0))
        batch = sched.schedule()
        assert batch is not None and all(e.request is not low for e in batch.entries)
        sched.commit(batch, model.step(batch))


@pytest.mark.parametrize("policy", POLICIES)
def test_the_queue_keeps_a_level_only_while_it_holds_requests(policy: str) -> None:
    """Every priority in the range passed through (2,001 levels): none is kept once empty, so
    a walk of the queue costs what its non-empty levels cost, not what it ever saw."""
    queue = PriorityLevels(lambda: make_queue(policy, 16), aging_seconds=0.01)
    requests = [_request(rid, priority=p) for rid, p in
                enumerate(range(-PRIORITY_LIMIT, PRIORITY_LIMIT + 1))]
    for request in requests:
        request.arrival = int(request.id)
        queue.push(request, 0)
    assert queue.num_levels == len(requests)
    for request in requests[1:]:
        queue.running_started(request)  # admitted: its level counts it while it runs
        queue.remove(request)
    assert queue.num_levels == len(requests)  # dfs-weight still weighs the running ones
    for request in requests[1:]:
        queue.running_ended(request)
    assert queue.num_levels == 1
    assert list(queue.candidates()) == [requests[0]]
    queue.remove(requests[0])
    assert queue.num_levels == 0 and len(queue) == 0
