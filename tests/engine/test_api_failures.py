"""A request whose processing fails fails alone; a dead loop fails every waiter at once and
every later call with EngineDeadError."""

from __future__ import annotations

import threading

import pytest
from engine_helpers import assert_idle_accounting, greedy

from engine.api import EngineDeadError
from engine.serving import job as serving_job
from engine.serving.detokenizer import IncrementalDetokenizer


class InjectedFailure(RuntimeError):
    pass


class DetokenizerBrokenAtThirdToken(IncrementalDetokenizer):
    """Processing this request's third token raises (on the engine loop thread)."""

    def push(self, token: int) -> str:
        self.pushed = getattr(self, "pushed", 0) + 1
        if self.pushed >= 3:
            raise InjectedFailure("the request broke at token 3")
        return super().push(token)


def submit_broken(engine, monkeypatch, prompt: str, stream: bool = False):
    with monkeypatch.context() as patch:
        patch.setattr(serving_job, "IncrementalDetokenizer", DetokenizerBrokenAtThirdToken)
        return engine.submit(prompt, greedy(20), stream=stream)


def test_a_failing_request_does_not_hurt_its_neighbours(
    engine, tokenizer, hf_greedy, monkeypatch
) -> None:
    prompts = [f"Neighbour {i} says that" for i in range(3)]
    before = engine.stats()
    doomed = submit_broken(engine, monkeypatch, "This request is doomed because")
    outs = engine.generate(prompts, greedy(10))
    with pytest.raises(InjectedFailure, match="broke at token 3"):
        doomed.result(timeout=120)
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == hf_greedy(tokenizer.encode(prompt), 10)
    assert engine.stats().failed == before.failed + 1
    assert_idle_accounting(engine)


def test_a_failing_stream_raises_its_error_after_its_deltas(engine, monkeypatch) -> None:
    handle = submit_broken(engine, monkeypatch, "Once upon a time", stream=True)
    seen: list[str] = []
    with pytest.raises(InjectedFailure):
        for item in handle:
            seen.append(item)
    assert len(seen) <= 2
    assert_idle_accounting(engine)


def test_a_dead_loop_fails_every_waiter_and_later_calls(make_engine) -> None:
    eng = make_engine(page_size=16, num_pages=64)
    scheduler = eng._loop._scheduler
    real_commit = scheduler.commit
    commits = 0

    def commit_then_break(batch, tokens, hit_stop_string=()):
        nonlocal commits
        commits += 1
        if commits == 3:
            raise RuntimeError("scheduler state corrupted")
        return real_commit(batch, tokens, hit_stop_string)

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


def test_every_concurrent_close_returns_only_once_the_loop_has_stopped(make_engine) -> None:
    """A server's grace timer and its main thread may close at once; the one that comes second
    must not return (and let the process exit) while the loop is still mid-pass."""
    eng = make_engine(page_size=16, num_pages=32)
    stream = eng.stream("Once upon a time", greedy(300, ignore_eos=True))
    assert isinstance(next(stream), str)
    loop_alive_at_return: list[bool] = []

    def close() -> None:
        eng.close()
        loop_alive_at_return.append(eng._loop.alive)

    closers = [threading.Thread(target=close) for _ in range(4)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(60)
    assert loop_alive_at_return == [False] * 4
    assert list(stream)[-1].finish_reason == "abort"


def test_close_gives_requests_still_queued_an_abort_not_a_hang(make_engine) -> None:
    """Requests submitted just before close() were taken from the inbox together with the
    close and dropped: their callers waited forever."""
    for _ in range(3):
        eng = make_engine(page_size=16, num_pages=32)
        handles = [eng.submit(f"Story {k}:", greedy(50)) for k in range(4)]
        eng.close()
        assert [h.result(timeout=30).finish_reason for h in handles] == ["abort"] * 4


def test_a_result_can_be_read_again_once_taken(engine) -> None:
    handle = engine.submit("Say yes.", greedy(3))
    first = handle.result(timeout=120)
    assert handle.result(timeout=1) is first
    assert list(handle) == [first]

    async def again():
        return await handle.aresult()

    import asyncio

    assert asyncio.run(again()) is first


def test_params_changed_after_they_were_made_are_checked_at_the_call(engine) -> None:
    """SamplingParams is frozen, its list and dict fields are not: a value put in them after
    the check is refused at the call, and one put in while the request runs changes nothing
    (the engine runs its own copy; its loop had died on a NaN bias)."""
    changed = greedy(3)
    changed.logit_bias[5] = float("nan")
    with pytest.raises(ValueError, match=r"^params\.logit_bias\[5\]: must be a number"):
        engine.generate("Hello", changed)
    negative = greedy(3)
    negative.stop_token_ids.append(-1)
    with pytest.raises(ValueError, match=r"^params\.stop_token_ids: must be a list of integers"):
        engine.generate("Hello", negative)
    params = greedy(12, ignore_eos=True)
    [expected] = engine.generate("Hello", params)
    handle = engine.submit("Hello", params)
    params.logit_bias[expected.token_ids[0]] = float("nan")
    params.stop.append("")
    assert handle.result(timeout=120).token_ids == expected.token_ids
    assert engine.alive
    assert_idle_accounting(engine)
