"""Following a request's engine requests to the client: waiting for all of them, or streaming
their deltas as Server-Sent Events, and aborting all of them when the client leaves.

An HTTP request becomes ``Choice``s (one engine request each, see ``generation.submit``).
``wait`` gathers their outputs; ``updates`` interleaves their deltas as they come. Both watch
the ASGI ``receive`` channel for the client leaving, whatever the host (uvicorn, Ray Serve)
and its ASGI spec version, and abort every choice at once so their pages go back to the pool
within a step. Every output, aborted ones too, is observed (the metrics, the access line)
exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.api import Delta, RequestHandle, RequestOutput, TokenLogprob

if TYPE_CHECKING:
    from server.state import ServerState


@dataclass(slots=True)
class Choice:
    """One engine request of an API request: choice ``index``, on prompt ``prompt``."""

    index: int
    prompt: int
    handle: RequestHandle


@dataclass(slots=True)
class Update:
    """New text and tokens of one choice of a stream; ``output`` is set on its last update."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    output: RequestOutput | None = None
    # The prompt's log-probabilities, on a choice's first update (when asked).
    prompt_logprobs: list[TokenLogprob | None] | None = None


def sse(data: Any) -> bytes:
    """One Server-Sent Event: ``data: <json>`` and a blank line (msgspec: several times
    faster than json.dumps on the chunks of every token)."""
    payload = data.encode() if isinstance(data, str) else msgspec.json.encode(data)
    return b"data: " + payload + b"\n\n"


async def client_gone(receive: Receive) -> None:
    """Returns when the client has disconnected (run once the body has been read, when
    what ``receive`` still delivers is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStreamResponse(StreamingResponse):
    """SSE that always watches for the client leaving: Starlette does so only under ASGI spec
    < 2.4; mounted elsewhere (Ray Serve) a disconnect would go unnoticed until the next write,
    and a long prefill or a stalled queue writes nothing."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(client_gone(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            for task in (stream, watcher):
                with contextlib.suppress(BaseException):
                    await task
            # The generator's own finally aborts its requests; close it if it never started.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with contextlib.suppress(BaseException):
                    await close()


async def wait(
    state: ServerState, request: Request, choices: list[Choice]
) -> list[RequestOutput] | None:
    """Every choice's output, or None when the client left first. Whatever ends the wait
    (the client leaving, a choice failing, a cancellation), the choices still running are
    aborted, and the outputs that came are observed: a choice that finished before the client
    left has already given its output here, and nobody can take it again."""
    finals = [asyncio.ensure_future(c.handle.aresult()) for c in choices]
    everything = asyncio.gather(*finals)
    watcher = asyncio.ensure_future(client_gone(request.receive))
    outputs: list[RequestOutput] | None = None
    try:
        await asyncio.wait({everything, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if everything.done():
            outputs = everything.result()
        return outputs
    finally:
        watcher.cancel()
        # what the cancelled or failed gather holds is nobody's news
        everything.add_done_callback(lambda done: done.cancelled() or done.exception())
        left = []
        for choice, final in zip(choices, finals):
            if not final.done():
                final.cancel()
                left.append(choice)
            elif not final.cancelled() and final.exception() is None:
                state.observe(final.result())
        abort(state, left)


async def updates(state: ServerState, choices: list[Choice]) -> AsyncIterator[Update]:
    """Every choice's new text and tokens as they come, interleaved; a choice's last update
    carries its finish reason, the tokens no delta carried (a stop token) and its output.
    Leaving early (a disconnect cancels the stream) aborts every choice still running."""
    queue: asyncio.Queue[tuple[Choice, Any]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for item in choice.handle.events():
                queue.put_nowait((choice, item))
        except BaseException as exc:
            queue.put_nowait((choice, exc))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    sent = {c.index: 0 for c in choices}  # tokens streamed per choice
    ended: set[int] = set()
    started: set[int] = set()
    try:
        while len(ended) < len(choices):
            choice, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            first = choice.index not in started
            started.add(choice.index)
            if isinstance(item, Delta):
                sent[choice.index] += len(item.token_ids)
                scores = None if item.prompt_logprobs is None else list(item.prompt_logprobs)
                yield Update(
                    choice, item.text, list(item.token_ids), list(item.logprobs), None, scores
                )
                continue
            ended.add(choice.index)
            state.observe(item)
            tail = sent[choice.index]
            scores = item.prompt_logprobs if first else None
            yield Update(
                choice, "", item.token_ids[tail:], (item.logprobs or [])[tail:], item, scores
            )
    finally:
        for task in tasks:
            task.cancel()
        while not queue.empty():  # outputs taken from their handles, not read here yet
            choice, item = queue.get_nowait()
            if isinstance(item, RequestOutput) and choice.index not in ended:
                ended.add(choice.index)
                state.observe(item)
        abort(state, [c for c in choices if c.index not in ended])


def abort(state: ServerState, choices: list[Choice]) -> None:
    """Aborts ``choices`` now; their outputs (finish reason "abort") reach the metrics from a
    background task, since nobody waits for them any more."""
    if not choices:
        return
    for choice in choices:
        choice.handle.abort()
    state.in_background(_observe(state, choices))


async def _observe(state: ServerState, choices: list[Choice]) -> None:
    async def one(choice: Choice) -> None:
        with contextlib.suppress(BaseException):
            state.observe(await choice.handle.aresult())

    await asyncio.gather(*(one(choice) for choice in choices))  # none waits on another
