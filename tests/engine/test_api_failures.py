"""A request whose processing fails fails alone; a dead loop fails every waiter at once and
every later call with EngineDeadError."""

from __future__ import annotations

import threading

import pytest
from engine_helpers import assert_idle_accounting, greedy

from engine import EngineDeadError


class InjectedFailure(RuntimeError):
    pass


def _fail_at_third_token(request) -> None:
    if len(request.output) >= 3:
        raise InjectedFailure(f"request {request.id} broke at token 3")


def test_a_failing_request_does_not_hurt_its_neighbours(engine, tokenizer, hf_greedy) -> None:
    prompts = [f"Neighbour {i} says that" for i in range(3)]
    failure: list[BaseException] = []

    def doomed() -> None:
        prepared = engine._prepare("This request is doomed because", greedy(20), None)
        try:
            engine._generate_prepared(prepared, None, hook=_fail_at_third_token)
        except InjectedFailure as exc:
            failure.append(exc)

    before = engine.stats()
    thread = threading.Thread(target=doomed)
    thread.start()
    outs = engine.generate(prompts, greedy(10))
    thread.join(timeout=120)
    assert len(failure) == 1 and "broke at token 3" in str(failure[0])
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == hf_greedy(tokenizer.encode(prompt), 10)
    assert engine.stats().failed == before.failed + 1
    assert_idle_accounting(engine)


def test_a_failing_stream_raises_its_error_after_its_deltas(engine) -> None:
    prepared = engine._prepare("Once upon a time", greedy(20), None)[0]
    seen: list[str] = []
    with pytest.raises(InjectedFailure):
        for item in engine._stream_prepared(prepared, None, hook=_fail_at_third_token):
            seen.append(item)
    assert len(seen) <= 2
    assert_idle_accounting(engine)


def test_a_dead_loop_fails_every_waiter_and_later_calls(make_engine) -> None:
    eng = make_engine(page_size=16, num_pages=64)
    scheduler = eng._loop._scheduler
    real_commit = scheduler.commit
    commits = 0

    def commit_then_break(batch, tokens):
        nonlocal commits
        commits += 1
        if commits == 3:
            raise RuntimeError("scheduler state corrupted")
        return real_commit(batch, tokens)

    scheduler.commit = commit_then_break  # fault injection into the loop itself
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        try:
            eng.generate(f"Caller {i} asks", greedy(50))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a waiter hung after the loop died"
    assert len(errors) == 4
    assert all(isinstance(e, EngineDeadError) for e in errors)
    assert all("scheduler state corrupted" in str(e.__cause__) for e in errors)
    with pytest.raises(EngineDeadError, match="the engine loop died"):
        eng.generate("after death", greedy(2))
    with pytest.raises(EngineDeadError):
        eng.wait_idle(timeout=1)


def test_a_closed_engine_refuses_work(make_engine) -> None:
    eng = make_engine(page_size=16, num_pages=16)
    [out] = eng.generate("Hello", greedy(2))
    assert out.finish_reason == "length"
    eng.close()
    assert eng.closed
    with pytest.raises(EngineDeadError, match="closed"):
        eng.generate("Hello", greedy(2))
    eng.close()  # idempotent


def test_close_aborts_requests_in_flight(make_engine) -> None:
    eng = make_engine(page_size=16, num_pages=32)
    stream = eng.stream("Once upon a time", greedy(300, ignore_eos=True))
    assert isinstance(next(stream), str)
    eng.close()
    *_, final = list(stream)
    assert final.finish_reason == "abort"
    assert len(final.token_ids) < 300
