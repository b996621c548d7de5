"""The seam's words (engine.api): one context rule, and a handle whose producer puts events
through its sink, so an engine loop and a replica's front deliver the same way."""

from __future__ import annotations

import pytest

from engine.api import ContextLengthError, RequestHandle, RequestOutput, context_limit


def _output(text: str) -> RequestOutput:
    return RequestOutput(text, [1], "stop", 3, 0, 0.01, 0.02)


def test_the_pool_holds_every_token_but_the_last_generated_one() -> None:
    assert context_limit(2048, 127) == 128
    assert context_limit(100, 127) == 100
    assert context_limit(2048, None) == 2048
    assert context_limit(None, 127) == 128
    with pytest.raises(ValueError):
        context_limit(None, None)


def test_a_context_error_states_the_limit_as_tokens_a_request_may_hold() -> None:
    of_pool = ContextLengthError("x", "prompt", 100, 40, limit=127, of_pool=True)
    of_model = ContextLengthError("x", "prompt", 100, 40, limit=128, of_pool=False)
    assert of_pool.context == of_model.context == 128


def test_a_sink_delivers_deltas_then_one_final_output_to_its_handle() -> None:
    from engine.api import Delta

    aborted: list[int] = []
    handle, sink = RequestHandle.open(7, aborted.append)
    sink.delta(Delta("He"))
    sink.delta(Delta("llo"))
    assert not handle.finished and not sink.finished
    sink.finish(_output("Hello"))
    assert handle.finished and sink.finished
    assert list(handle) == ["He", "llo", _output("Hello")]
    handle.abort()  # finished: a no-op
    assert aborted == []


def test_a_failure_put_in_the_sink_is_raised_to_the_caller() -> None:
    aborted: list[int] = []
    handle, sink = RequestHandle.open(3, aborted.append)
    handle.abort()  # not finished: the producer is told
    assert aborted == [3]
    sink.fail(ValueError("prompt: too long"))
    with pytest.raises(ValueError, match="too long"):
        handle.result(timeout=1)
