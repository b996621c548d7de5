"""The front end's stand-in for an Engine: the OpenAI app runs on it unchanged, and every
request goes, as token ids, to whichever engine replica the router picks.

Tokenizing and validating happen here, once, with the engine's own ``PromptPreparer``: the
``EngineCall`` carries the checked ``PromptIds`` (which a replica's ``submit`` takes without
encoding or checking them again; it checks only that the request fits its own pool), the
sampling parameters and the namespace, which is all a router needs to hash the prompt. The
reply streams back as the engine's own events (``Delta`` ..., then the ``RequestOutput``),
put into the sink of an ordinary ``RequestHandle`` so the app cannot tell the difference.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from engine import ModelFront, PromptPreparer, SamplingParams, tools
from engine.api import (
    Delta,
    EngineDeadError,
    EngineStats,
    HandleSink,
    PromptIds,
    RequestHandle,
    RequestOutput,
    check_pin_ttl,
    context_limit,
)


class EngineCall(msgspec.Struct, frozen=True):
    """One request as a replica receives it. ``prompt`` is the prompt's text, for routers
    that match text (Ray Serve LLM's ``PrefixCacheAffinityRouter`` reads ``.prompt``)."""

    token_ids: PromptIds
    params: Any  # SamplingParams (a frozen msgspec Struct: pickled by Ray as is)
    namespace: str | None
    stream: bool
    prompt: str = ""
    pin_ttl: float | None = None  # pin the finished conversation on its replica
    unpin: bool = False  # instead of generating: end the pins on ``token_ids``' path


Stream = Callable[[EngineCall], Any]  # an async iterator of Delta / RequestOutput


log = logging.getLogger("radixkv.cluster")


class RemoteEngine:
    """An ``EngineClient`` for replicas behind a router: what the server calls with
    ``--replicas``."""

    def __init__(
        self,
        front: ModelFront,
        stream: Stream,
        pool_tokens: Callable[[], int | None],
        stats: Callable[[], EngineStats | None] = lambda: None,
        priority_scheduling: bool = False,
    ) -> None:
        self._front = front
        self._prompts = PromptPreparer(
            front.tokenizer, front.config.vocab_size, int(front.config.max_position_embeddings),
            priority_scheduling=priority_scheduling,
        )
        self._stream = stream
        self._pool_tokens = pool_tokens
        self._stats = stats
        self._ids = itertools.count()
        self._running: dict[int, asyncio.Task[None]] = {}
        self._unpinning: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def tokenizer(self) -> Any:
        return self._front.tokenizer

    @property
    def model_config(self) -> Any:
        return self._front.config

    @property
    def tool_format(self) -> Any:
        """The model's tool format, as its replicas' engines have it (by its template)."""
        return tools.tool_format_for(getattr(self._front.tokenizer, "chat_template", None))

    @property
    def max_context(self) -> int:
        """The model's context, or what a replica's KV pool holds for one request where that
        is less (once a replica has reported its pool)."""
        return context_limit(int(self._front.config.max_position_embeddings), self._pool_tokens())

    @property
    def alive(self) -> bool:
        return not self._closed

    def encode(
        self,
        prompt: Any,
        field: str = "prompt",
        truncate_prompt_tokens: int | None = None,
        continuing: Sequence[int] | None = None,
    ) -> PromptIds:
        return self._prompts.encode(
            prompt, field, truncate_prompt_tokens, self._pool_tokens(), continuing
        )

    def submit(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        namespace: str | None = None,
        stream: bool = False,
        pin_ttl: float | None = None,
    ) -> RequestHandle:
        """Validates here, as an Engine does (ValueError naming the field), and starts the
        remote request."""
        pool = self._pool_tokens()  # None until a replica reported (the context bounds it)
        pool = pool if pool is not None else int(self._front.config.max_position_embeddings)
        [(ids, p)] = self._prompts.prepare(prompt, params, namespace, pool, single=True)
        text = self.tokenizer.decode(ids)
        ids = ids if isinstance(ids, PromptIds) else PromptIds(ids)  # checked: replicas trust it
        call = EngineCall(ids, p, namespace, stream, text, check_pin_ttl(pin_ttl, "pin_ttl"))
        request_id = next(self._ids)
        handle, sink = RequestHandle.open(request_id, self._abort)
        task = asyncio.get_running_loop().create_task(self._pump(call, sink))
        self._running[request_id] = task
        task.add_done_callback(lambda _: self._ended(request_id, sink))
        return handle

    def unpin_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> None:
        """Sent as a call of its own, routed as a request on ``token_ids`` would be: to the
        replica holding them (the one that pinned them, under the cache-aware router)."""
        call = EngineCall(PromptIds(token_ids), None, namespace, False, unpin=True)
        task = asyncio.get_running_loop().create_task(self._send(call))
        self._unpinning.add(task)
        task.add_done_callback(self._unpinning.discard)

    async def _send(self, call: EngineCall) -> None:
        try:
            async for _ in self._stream(call):
                pass
        except Exception as exc:  # noqa: BLE001 - a pin left to its lifetime is no error
            log.warning("unpinning on a replica failed: %r", exc)

    def _ended(self, request_id: int, sink: HandleSink) -> None:
        """A request's pump is done. One cancelled before it first ran (aborted at once)
        never reached its own ``except``: its handle still gets its end."""
        self._running.pop(request_id, None)
        if not sink.finished:
            sink.fail(RuntimeError("aborted"))

    async def _pump(self, call: EngineCall, sink: HandleSink) -> None:
        stream = self._stream(call)
        try:
            async for item in stream:
                if isinstance(item, Delta):
                    sink.delta(item)
                elif isinstance(item, RequestOutput):
                    sink.finish(item)
                    return
            sink.fail(RuntimeError("the replica ended the stream without an output"))
        except asyncio.CancelledError:  # aborted: stop the replica's generator too
            cancel = getattr(stream, "cancel", None)
            if callable(cancel):
                cancel()
            sink.fail(RuntimeError("aborted"))
            raise
        except BaseException as exc:  # the replica's error, re-raised by the app
            sink.fail(_client_error(exc))

    def _abort(self, request_id: int) -> None:
        """Cancelling the stream cancels the replica's generator, which aborts its request."""
        task = self._running.get(request_id)
        if task is not None:
            task.cancel()

    def num_waiting(self) -> int:
        """Requests sent and not yet running, as an Engine counts them (what ``--max-queued``
        counts): those in flight less those the replicas report running (as of their last
        report; no more than are in flight)."""
        in_flight = len(self._running)
        return in_flight - min(in_flight, self.stats().requests_running)

    def num_in_flight(self) -> int:
        """Requests sent and not yet answered, queued or running (what a drain waits out)."""
        return len(self._running)

    def stats(self) -> EngineStats:
        """The replicas' stats added up (as of their last report), or zeros before any."""
        return self._stats() or EngineStats.zero()

    def close(self) -> None:
        self._closed = True
        for task in list(self._running.values()):
            task.cancel()


def _client_error(exc: BaseException) -> BaseException:
    """What the client is told: the request's own fault as the replica raised it (a
    ValueError: 400), anything else (a replica that died, Ray's errors, which name pids,
    node addresses and actor ids) as a plain retryable failure, with the details logged."""
    cause = _unwrap(exc)
    if isinstance(cause, ValueError):
        return cause
    log.warning("a replica failed a request: %r", exc)
    return EngineDeadError("the replica serving this request failed; retry")


def _unwrap(exc: BaseException) -> BaseException:
    """Ray wraps a replica's exception; the app maps the original (ValueError -> 400)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return cause
    as_cause = getattr(exc, "as_instanceof_cause", None)
    if callable(as_cause):
        with contextlib.suppress(Exception):
            return as_cause()
    return exc
