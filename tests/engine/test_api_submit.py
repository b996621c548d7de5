"""Engine.submit and its RequestHandle: queued at once, waited on from any thread or coroutine,
aborted from any thread; every other API is built on it."""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine_helpers import assert_idle_accounting, greedy

LONG = greedy(200, ignore_eos=True)


def test_submit_returns_at_once_and_its_result_equals_generate(engine) -> None:
    handle = engine.submit("The capital of France is", greedy(8))
    out = handle.result(timeout=120)
    assert handle.finished
    [expected] = engine.generate("The capital of France is", greedy(8))
    assert out.token_ids == expected.token_ids and out.text == expected.text
    assert_idle_accounting(engine)


def test_bad_input_raises_at_submit_and_queues_nothing(engine) -> None:
    before = engine.stats().counters.requests
    with pytest.raises(ValueError, match="prompt: empty prompt"):
        engine.submit("")
    with pytest.raises(ValueError, match="prompt: expected one prompt"):
        engine.submit(["a", "b"])
    assert engine.stats().counters.requests == before


def test_abort_from_another_thread_frees_the_pages(engine) -> None:
    handle = engine.submit("Write a long story about a lighthouse keeper.", LONG, stream=True)
    items = iter(handle)
    assert isinstance(next(items), str)  # running
    aborter = threading.Thread(target=handle.abort)
    aborter.start()
    aborter.join()
    *_, out = list(items)
    assert out.finish_reason == "abort" and len(out.token_ids) < 200
    handle.abort()  # a no-op once it ended
    assert_idle_accounting(engine)


def test_streamed_deltas_concatenate_to_the_text(engine) -> None:
    items = list(engine.submit("Once upon a time", greedy(16), stream=True))
    *deltas, out = items
    assert all(isinstance(d, str) for d in deltas)
    assert "".join(deltas) == out.text and out.finish_reason in ("stop", "length")


def test_leaving_a_handle_loop_early_aborts_the_request(engine) -> None:
    before = engine.stats().counters.aborted
    handle = engine.submit("Tell me everything about rivers.", LONG, stream=True)
    for _ in handle:
        break
    assert_idle_accounting(engine)
    assert engine.stats().counters.aborted == before + 1


def test_aresult_and_async_iteration_in_an_event_loop(engine) -> None:
    async def main() -> tuple[str, str]:
        first = engine.submit("The sky is", greedy(6))
        streamed = [item async for item in engine.submit("The sea is", greedy(6), stream=True)]
        out = await first.aresult()
        return out.text, "".join(streamed[:-1])

    text, streamed = asyncio.run(main())
    [expected_first, expected_second] = engine.generate(["The sky is", "The sea is"], greedy(6))
    assert text == expected_first.text and streamed == expected_second.text
    assert_idle_accounting(engine)
