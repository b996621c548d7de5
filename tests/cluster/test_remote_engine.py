"""The front end's RemoteEngine: validation happens before anything is sent, and the
replicas' stats add up to one engine's."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgspec
import pytest

from cluster.remote import EngineCall, RemoteEngine
from engine import SamplingParams
from engine.api import EngineStats
from engine.model.loader import load_front


@pytest.fixture(scope="module")
def front() -> Any:
    return load_front()


def test_bad_requests_are_refused_before_any_replica_sees_them(front: Any) -> None:
    sent: list[EngineCall] = []

    def stream(call: EngineCall) -> Any:
        sent.append(call)
        raise AssertionError("nothing should be sent")

    remote = RemoteEngine(front, stream, lambda: 64)

    async def submit(**kwargs: Any) -> None:
        remote.submit(**kwargs)

    for kwargs, field in (
        (
            {"prompt": "hi", "params": SamplingParams(max_new_tokens=10), "namespace": 5},
            "namespace",
        ),
        ({"prompt": [front.config.vocab_size], "params": None}, "prompt"),
        ({"prompt": "hi " * 40, "params": SamplingParams(max_new_tokens=40)}, "prompt"),
        # replicas scheduling first come, first served: the front refuses a priority too
        ({"prompt": "hi", "params": SamplingParams(max_new_tokens=4, priority=-5)}, "priority"),
    ):
        with pytest.raises(ValueError, match=field):
            asyncio.run(submit(**kwargs))
    assert sent == []
    allowed = RemoteEngine(front, stream, lambda: 64, priority_scheduling=True)
    allowed._prompts.prepare("hi", SamplingParams(max_new_tokens=4, priority=-5), None, 64)


def _recording(sent: list[EngineCall]) -> Any:
    """A replica stream that keeps each call and answers nothing."""

    async def stream(call: EngineCall) -> Any:
        sent.append(call)
        return
        yield

    return stream


def test_a_request_goes_out_as_token_ids_with_its_text(front: Any) -> None:
    sent: list[EngineCall] = []
    remote = RemoteEngine(front, _recording(sent), lambda: None)

    async def run() -> None:
        handle = remote.submit("Hello there", SamplingParams(max_new_tokens=3), "tenant")
        with pytest.raises(RuntimeError, match="without an output"):
            await handle.aresult()

    asyncio.run(run())
    [call] = sent
    assert call.token_ids == front.tokenizer.encode("Hello there")
    assert call.namespace == "tenant" and call.prompt == "Hello there"


def test_an_unpin_goes_out_as_a_call_of_its_own_routed_by_its_tokens(front: Any) -> None:
    sent: list[EngineCall] = []
    remote = RemoteEngine(front, _recording(sent), lambda: None)

    async def run() -> None:
        remote.unpin_prefix([5, 6, 7, 8], "tenant")
        while remote._unpinning:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    [call] = sent
    assert call.unpin and list(call.token_ids) == [5, 6, 7, 8] and call.namespace == "tenant"


def test_a_replica_failure_reaches_the_client_without_ray_internals(front: Any) -> None:
    """A replica that dies mid-request (Ray raises an error naming pids, node addresses and
    actor ids) is a plain retryable failure to the client; a ValueError from the replica
    (the request's own fault) still reaches it as it was raised."""
    from engine.api import EngineDeadError

    class ActorDiedError(RuntimeError):
        """Shaped like Ray's: the message carries the internals."""

    failures: list[BaseException] = [
        ActorDiedError("The actor died. pid=4242, ip=10.0.0.7, actor_id=8f2c, namespace=serve"),
        ValueError("max_new_tokens: over the context"),
    ]

    async def stream(call: EngineCall) -> Any:
        raise failures.pop(0)
        yield

    remote = RemoteEngine(front, stream, lambda: None)

    async def run() -> list[BaseException]:
        errors = []
        for _ in range(2):
            handle = remote.submit("Hello", SamplingParams(max_new_tokens=3))
            try:
                await handle.aresult()
            except BaseException as exc:  # noqa: BLE001 - what the app would be handed
                errors.append(exc)
        return errors

    died, bad = asyncio.run(run())
    assert isinstance(died, EngineDeadError) and str(died) == (
        "the replica serving this request failed; retry"
    )
    assert isinstance(bad, ValueError) and "max_new_tokens" in str(bad)


def test_replicas_stats_add_up_and_the_hit_rate_is_recomputed() -> None:
    zero = EngineStats.zero()

    def stats(counters: dict, pages: dict, tiers: dict) -> EngineStats:
        return msgspec.structs.replace(
            zero,
            counters=dataclasses.replace(zero.counters, **counters),
            pages=dataclasses.replace(zero.pages, **pages),
            tiers=dataclasses.replace(zero.tiers, **tiers),
        )

    a = stats(
        {"requests": 3, "prompt_tokens": 100, "cached_tokens": 50},
        {"total": 64, "free": 64},
        {"compute_s_per_page": 0.02},
    )
    b = stats(
        {"requests": 1, "prompt_tokens": 100, "cached_tokens": 0},
        {"total": 64, "free": 60, "cached": 4},
        {},
    )
    total = EngineStats.total([a, b])
    assert (total.counters.requests, total.pages.total, total.pages.free) == (4, 128, 124)
    assert total.hit_rate == pytest.approx(0.25)
    assert total.tiers.compute_s_per_page == pytest.approx(0.02)  # the one replica that measured
    assert EngineStats.total([]) == zero


def test_queued_counts_what_no_replica_runs_yet_and_in_flight_everything_unanswered(
    front: Any,
) -> None:
    """``num_waiting`` means what it means in an Engine (queued, what --max-queued counts);
    a drain waits for every request in flight."""
    running = 0

    async def stream(call: EngineCall) -> Any:
        await asyncio.sleep(3600)
        yield

    def stats() -> EngineStats:
        return msgspec.structs.replace(EngineStats.zero(), requests_running=running)

    remote = RemoteEngine(front, stream, lambda: None, stats)

    async def run() -> None:
        nonlocal running
        handles = [remote.submit("Hi", SamplingParams(max_new_tokens=2)) for _ in range(3)]
        await asyncio.sleep(0)  # the requests go out
        assert remote.num_in_flight() == 3 and remote.num_waiting() == 3
        running = 2  # the replicas report two of them running
        assert remote.num_in_flight() == 3 and remote.num_waiting() == 1
        running = 5  # a stale report never makes the queue negative
        assert remote.num_waiting() == 0
        for handle in handles:
            handle.abort()
            with pytest.raises(RuntimeError, match="aborted"):
                await handle.aresult()
        assert remote.num_in_flight() == 0

    asyncio.run(run())


def test_a_request_aborted_before_it_went_out_still_ends(front: Any) -> None:
    """Aborted in the same tick it was submitted, its pump is cancelled before it first runs:
    the handle must still get its end (it waited forever before)."""

    async def stream(call: EngineCall) -> Any:
        await asyncio.sleep(3600)
        yield

    remote = RemoteEngine(front, stream, lambda: None, lambda: None)

    async def run() -> None:
        handle = remote.submit("Hi", SamplingParams(max_new_tokens=2))
        handle.abort()  # no await in between: the pump never started
        with pytest.raises(RuntimeError, match="aborted"):
            await asyncio.wait_for(handle.aresult(), timeout=5)
        assert remote.num_in_flight() == 0

    asyncio.run(run())


def test_the_front_and_an_engine_bound_a_request_by_one_rule(front: Any) -> None:
    """The pool holds every token but the last generated one (``context_limit``)."""
    context = int(front.config.max_position_embeddings)
    assert RemoteEngine(front, lambda call: None, lambda: None).max_context == context
    assert RemoteEngine(front, lambda call: None, lambda: 63).max_context == 64
    assert RemoteEngine(front, lambda call: None, lambda: 10**9).max_context == context
