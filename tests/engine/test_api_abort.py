"""Abort paths: an early-closed stream, a cancelled task, a closed async stream. Each aborts its
request, and at idle every page is free or cached again."""

from __future__ import annotations

import asyncio
import time

from engine_helpers import assert_idle_accounting, greedy

LONG = greedy(200, ignore_eos=True)  # runs its full length: there is time to abort it
STORY = [{"role": "user", "content": "Write a long story about a dragon who bakes bread."}]


def _wait_running(engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats().requests_running == 0:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.005)


def test_closing_a_stream_early_aborts_and_frees_pages(engine) -> None:
    before = engine.stats()
    stream = engine.stream(STORY, LONG)
    first = next(stream)
    assert isinstance(first, str)
    stream.close()
    assert_idle_accounting(engine)
    after = engine.stats()
    assert after.counters.aborted == before.counters.aborted + 1
    assert after.counters.generated_tokens - before.counters.generated_tokens < 200


def test_cancelling_an_agenerate_task_aborts_the_request(engine) -> None:
    before = engine.stats()

    async def main() -> None:
        task = asyncio.ensure_future(engine.agenerate([STORY, "Once upon a time"], LONG))
        await asyncio.get_running_loop().run_in_executor(None, _wait_running, engine)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return
        raise AssertionError("task was not cancelled")

    asyncio.run(main())
    assert_idle_accounting(engine)
    assert engine.stats().counters.aborted == before.counters.aborted + 2


def test_closing_an_async_stream_early_aborts(engine) -> None:
    before = engine.stats()

    async def main() -> str:
        stream = engine.astream(STORY, LONG)
        first = await stream.__anext__()
        await stream.aclose()
        return first

    assert isinstance(asyncio.run(main()), str)
    assert_idle_accounting(engine)
    assert engine.stats().counters.aborted == before.counters.aborted + 1


def test_engine_keeps_working_after_aborts(engine, tokenizer, hf_greedy) -> None:
    stream = engine.stream(STORY, LONG)
    next(stream)
    stream.close()
    [out] = engine.generate("The sky is", greedy(5))
    assert out.token_ids == hf_greedy(tokenizer.encode("The sky is"), 5)
    assert out.finish_reason == "length"


def test_a_stream_never_started_submits_nothing(engine) -> None:
    before = engine.stats().counters.requests
    stream = engine.stream(STORY, LONG)
    del stream
    assert engine.wait_idle(timeout=30)
    assert engine.stats().counters.requests == before
