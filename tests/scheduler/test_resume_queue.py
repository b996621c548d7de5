"""The resume queue keeps preempted requests oldest arrival first, whatever order they come
back in and whichever of them are aborted (a reference list sorted each time)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Request, SamplingParams
from scheduler.resume_queue import ResumeQueue


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "pop", "remove"]), st.integers(0, 30)),
                max_size=60))
def test_the_head_is_always_the_oldest_arrival_held(ops: list[tuple[str, int]]) -> None:
    queue = ResumeQueue()
    held: list[Request] = []
    made = 0
    for op, arrival in ops:
        if op == "push":
            request = Request(made, [1], SamplingParams(max_new_tokens=1))
            request.arrival = arrival
            made += 1
            queue.push(request)
            held.append(request)
        elif op == "pop" and held:
            head = queue.pop_head()
            assert head.arrival == min(r.arrival for r in held)
            held.remove(head)
        elif op == "remove" and held:
            victim = held[arrival % len(held)]
            queue.remove(victim)
            held.remove(victim)
        assert len(queue) == len(held)
        assert [r.arrival for r in queue] == sorted(r.arrival for r in held)
