"""Nothing a caller passes kills the engine loop (issue 60 #1, #2): pin lifetimes are checked
where they enter, and a command that raises on the loop fails alone while every other request
and every later call goes on."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import assert_idle_accounting, greedy

PROMPT = " ".join(f"The river ran past mill {i} and the mill kept turning." for i in range(8))


def test_a_pin_without_a_lifetime_or_past_the_bound_is_a_value_error(make_engine: Any) -> None:
    eng = make_engine(num_pages=64)
    eng.generate([PROMPT], greedy(2))
    with pytest.raises(ValueError, match="ttl: required"):
        eng.pin(PROMPT, ttl=None)
    with pytest.raises(ValueError, match=r"ttl: must be a number of seconds in \(0, 2592000\]"):
        eng.pin(PROMPT, ttl=1e10)
    with pytest.raises(ValueError, match="pin_ttl: must be"):
        eng.submit(PROMPT, greedy(2), pin_ttl=1e10)
    assert eng.pin(PROMPT, ttl=5.0).tokens > 0
    assert eng.generate([PROMPT], greedy(2))[0].token_ids
    assert eng._loop.alive


def test_a_command_that_raises_on_the_loop_fails_alone(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = make_engine(num_pages=64)
    expected = eng.generate([PROMPT], greedy(4))[0].token_ids
    pins = eng._loop._kv.pins

    def broken_pin(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in pin")

    monkeypatch.setattr(pins, "pin", broken_pin)
    with pytest.raises(RuntimeError, match="a bug in pin"):
        eng.pin(PROMPT, ttl=5.0)
    monkeypatch.undo()
    scheduler = eng._loop._scheduler
    real_add = scheduler.add
    calls = []

    def add_once_broken(request: Any) -> None:
        calls.append(request)
        if len(calls) == 1:
            raise KeyError("a bug in add")
        real_add(request)

    monkeypatch.setattr(scheduler, "add", add_once_broken)
    with pytest.raises(Exception, match="a bug in add"):
        eng.generate([PROMPT], greedy(4))
    assert eng.generate([PROMPT], greedy(4))[0].token_ids == expected
    assert eng._loop.alive
    assert_idle_accounting(eng)
