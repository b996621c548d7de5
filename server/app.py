"""The OpenAI-compatible HTTP app over one Engine: ``create_app(engine)``.

Starlette, not FastAPI: the request bodies are decoded by msgspec (already the engine's record
library, and it names the failing field), errors must be OpenAI's JSON with status 400 where
FastAPI's validation answers 422 in its own shape, and the app stays a plain ASGI callable
that uvicorn serves and Ray Serve can mount. Every request runs on the event loop through the
engine's asyncio API (``RequestHandle.events``); no thread per request.

A request with ``n`` choices is ``n`` engine requests on the same token ids: the scheduler
holds the later ones back until the first one's prefill has cached the prompt, so the prompt
is computed once. A client that disconnects aborts its requests at once (a watcher on the
ASGI ``receive`` channel, streaming or not), which frees their pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine import Engine, RequestOutput
from engine.serving.errors import EngineDeadError
from engine.serving.handle import Delta, RequestHandle
from scheduler import SamplingParams
from server import protocol
from server.errors import (
    APIError,
    engine_dead,
    internal,
    invalid,
    not_found,
    overloaded,
    unauthorized,
)
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import ChatRequest, CompletionRequest
from server.responses import (
    FINISH_REASONS,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage_of,
)
from server.tokens import TokenTexts

log = logging.getLogger("radixkv.server")

# OpenAI's legacy completions default; chat completions default to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class ServerConfig:
    """What ``radixkv serve`` sets beyond the engine."""

    model_name: str = "SmolLM2-135M-Instruct"
    api_key: str | None = None
    # Requests waiting for admission beyond which new ones get 503 + Retry-After (None: no
    # limit, as vLLM).
    max_queued: int | None = None
    close_engine_on_shutdown: bool = False
    extra_model_names: list[str] = field(default_factory=list)


@dataclass
class Choice:
    """One engine request of an API request: choice ``index``, on prompt ``prompt``."""

    index: int
    prompt: int
    handle: RequestHandle


class EventStreamResponse(StreamingResponse):
    """SSE that always watches for the client leaving: Starlette does so only under ASGI spec
    < 2.4; mounted elsewhere (Ray Serve) a disconnect would go unnoticed until the next write,
    and a long prefill or a stalled queue writes nothing."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_client_gone(receive))
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


async def _client_gone(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """The routes' shared state: the engine, its names, metrics, token texts."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.names = [config.model_name, *config.extra_model_names]
        self.metrics = ServerMetrics(engine, config.model_name)
        self.texts = TokenTexts(engine.tokenizer)
        self.created = int(time.time())
        self._background: set[asyncio.Future[None]] = set()

    # -------------------------------------------------------------------------- checks

    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), key):
            raise unauthorized()

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise not_found(
                f"model: {model!r} does not exist; this server serves {self.names}",
                param="model",
                code="model_not_found",
            )

    def check_queue(self) -> None:
        limit = self.config.max_queued
        if limit is not None and self.engine.num_waiting() >= limit:
            self.metrics.reject("queue_full")
            raise overloaded(
                f"the server is busy: {limit} requests already wait (--max-queued); retry later"
            )

    def max_tokens(self, asked: int | None, field_name: str, prompt_len: int, where: str) -> int:
        """The request's token budget, or a 400 when prompt + budget exceed the context."""
        context = self.engine.max_context
        if asked is None:
            asked = context - prompt_len
            if asked < 1:
                raise invalid(
                    f"{where}: this model's maximum context length is {context} tokens, and "
                    f"the prompt has {prompt_len}; shorten it",
                    param=where,
                    code="context_length_exceeded",
                )
            return asked
        if prompt_len + asked > context:
            raise invalid(
                f"{where}: this model's maximum context length is {context} tokens; the "
                f"request asks for {prompt_len + asked} ({prompt_len} in the prompt, "
                f"{asked} for {field_name}); shorten the prompt or lower {field_name}",
                param=where,
                code="context_length_exceeded",
            )
        return asked

    # ------------------------------------------------------------------------- running

    def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        namespace: str | None,
        stream: bool,
    ) -> list[Choice]:
        """Queues ``len(params)`` choices per prompt; all or nothing."""
        self.check_queue()
        choices: list[Choice] = []
        try:
            for p, ids in enumerate(prompts):
                for j, sampling in enumerate(params):
                    handle = self.engine.submit(ids, sampling, namespace, stream=stream)
                    choices.append(Choice(p * len(params) + j, p, handle))
        except BaseException:
            for choice in choices:
                choice.handle.abort()
            raise
        return choices

    async def wait(self, request: Request, choices: list[Choice]) -> list[RequestOutput] | None:
        """Every choice's output, or None when the client left first (all aborted then)."""
        results = asyncio.ensure_future(asyncio.gather(*(c.handle.aresult() for c in choices)))
        watcher = asyncio.ensure_future(_client_gone(request.receive))
        try:
            await asyncio.wait({results, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if results.done():
                outputs = results.result()
                for output in outputs:
                    self.metrics.observe(output)
                return outputs
            return None
        finally:
            watcher.cancel()
            if not results.done():
                results.cancel()
                for choice in choices:
                    choice.handle.abort()
                self._in_background(self._observe_aborted(choices))

    def _in_background(self, coroutine: Awaitable[None]) -> None:
        """Runs ``coroutine`` as a task the server holds until it ends (asyncio keeps only
        weak references to tasks)."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _observe_aborted(self, choices: list[Choice]) -> None:
        for choice in choices:
            with contextlib.suppress(BaseException):
                self.metrics.observe(await choice.handle.aresult())

    async def merged_events(
        self, choices: list[Choice]
    ) -> AsyncIterator[tuple[Choice, Delta | RequestOutput]]:
        """Every choice's deltas and output, interleaved as they come; leaving early (a
        disconnect cancels the stream) aborts every choice."""
        queue: asyncio.Queue[tuple[Choice, Any]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for item in choice.handle.events():
                    queue.put_nowait((choice, item))
            except BaseException as exc:
                queue.put_nowait((choice, exc))

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        ended: set[int] = set()
        try:
            while len(ended) < len(choices):
                choice, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestOutput):
                    ended.add(choice.index)
                    self.metrics.observe(item)
                yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            rest = [c for c in choices if c.index not in ended]
            for choice in rest:
                choice.handle.abort()
            if rest:
                self._in_background(self._observe_aborted(rest))

    # ------------------------------------------------------------------------ endpoints

    async def chat_completions(self, request: Request) -> Response:
        self.check_auth(request)
        req: ChatRequest = protocol.decode_body(await request.body(), ChatRequest)
        self.check_model(req.model)
        protocol.check_unsupported(req)
        protocol.check_chat_only(req)
        messages = protocol.conversation(req.messages)
        ids = self.engine.encode(messages, field="messages")
        asked = protocol.requested_max_tokens(
            req, "max_completion_tokens", req.max_completion_tokens
        )
        name = "max_completion_tokens"
        if asked is None:
            asked = protocol.requested_max_tokens(req, "max_tokens", req.max_tokens)
            name = "max_tokens"
        budget = self.max_tokens(asked, name, len(ids), "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        protocol.check_token_ids(req.stop_token_ids, self.engine.model_config.vocab_size)
        params = [protocol.sampling_params(req, budget, top, j) for j in range(req.n)]
        choices = self.submit([ids], params, req.cache_salt, req.stream)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return EventStreamResponse(self._chat_stream(rid, req, choices))
        outputs = await self.wait(request, choices)
        if outputs is None:
            return Response(status_code=499)  # nobody is there to read it
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": [self._chat_choice(req, c, o) for c, o in zip(choices, outputs)],
            "usage": usage_of([outputs]),
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return JSONResponse(body)

    def _chat_choice(self, req: ChatRequest, choice: Choice, out: RequestOutput) -> dict:
        item: dict[str, Any] = {
            "index": choice.index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": chat_logprobs(out.logprobs or [], self.texts) if req.logprobs else None,
            "finish_reason": FINISH_REASONS[out.finish_reason],
        }
        if req.return_token_ids:
            item["token_ids"] = out.token_ids
        return item

    async def _chat_stream(
        self, rid: str, req: ChatRequest, choices: list[Choice]
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice_items: list[dict[str, Any]]) -> bytes:
            body: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.config.model_name,
                "choices": choice_items,
            }
            if with_usage:
                body["usage"] = None
            return sse(body)

        def item(choice: Choice, delta: dict, ids: list[int], lps: list, reason: str | None):
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": delta,
                "logprobs": chat_logprobs(lps, self.texts) if req.logprobs else None,
                "finish_reason": reason,
            }
            if req.return_token_ids:
                entry["token_ids"] = ids
            return entry

        sent = {c.index: 0 for c in choices}
        outputs: list[RequestOutput] = []
        try:
            for choice in choices:
                yield chunk([item(choice, {"role": "assistant", "content": ""}, [], [], None)])
            async for choice, event in self.merged_events(choices):
                if isinstance(event, Delta):
                    sent[choice.index] += len(event.token_ids)
                    yield chunk(
                        [
                            item(
                                choice,
                                {"content": event.text},
                                list(event.token_ids),
                                list(event.logprobs),
                                None,
                            )
                        ]
                    )
                    continue
                outputs.append(event)
                tail = sent[choice.index]
                yield chunk(
                    [
                        item(
                            choice,
                            {},
                            event.token_ids[tail:],
                            (event.logprobs or [])[tail:],
                            FINISH_REASONS[event.finish_reason],
                        )
                    ]
                )
            if with_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.config.model_name,
                        "choices": [],
                        "usage": usage_of([outputs]),
                    }
                )
        except Exception as exc:  # in-band: the status line is long gone
            yield sse(_as_api_error(exc).body())
        yield sse("[DONE]")

    async def completions(self, request: Request) -> Response:
        self.check_auth(request)
        req: CompletionRequest = protocol.decode_body(await request.body(), CompletionRequest)
        self.check_model(req.model)
        protocol.check_unsupported(req)
        protocol.check_completion_only(req)
        prompts = protocol.completion_prompts(req.prompt)
        many = len(prompts) > 1
        token_ids = []
        for i, prompt in enumerate(prompts):
            token_ids.append(self.engine.encode(prompt, field=f"prompt[{i}]" if many else "prompt"))
        asked = protocol.requested_max_tokens(req, "max_tokens", req.max_tokens)
        if asked is None:
            asked = COMPLETIONS_DEFAULT_MAX_TOKENS
        budget = min(
            self.max_tokens(asked, "max_tokens", len(ids), f"prompt[{i}]" if many else "prompt")
            for i, ids in enumerate(token_ids)
        )
        protocol.check_token_ids(req.stop_token_ids, self.engine.model_config.vocab_size)
        params = [protocol.sampling_params(req, budget, req.logprobs, j) for j in range(req.n)]
        echo = [self._echo_text(p, ids) if req.echo else "" for p, ids in zip(prompts, token_ids)]
        choices = self.submit(token_ids, params, req.cache_salt, req.stream)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return EventStreamResponse(
                self._completion_stream(rid, req, choices, echo, token_ids)
            )
        outputs = await self.wait(request, choices)
        if outputs is None:
            return Response(status_code=499)
        items = []
        for choice, out in zip(choices, outputs):
            entry: dict[str, Any] = {
                "index": choice.index,
                "text": echo[choice.prompt] + out.text,
                "logprobs": None,
                "finish_reason": FINISH_REASONS[out.finish_reason],
            }
            if req.logprobs is not None:
                entry["logprobs"] = completion_logprobs(out.logprobs or [], self.texts, 0)[0]
            if req.return_token_ids:
                entry["token_ids"] = out.token_ids
                entry["prompt_token_ids"] = token_ids[choice.prompt]
            items.append(entry)
        by_prompt = [outputs[p * req.n : (p + 1) * req.n] for p in range(len(prompts))]
        body = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": items,
            "usage": usage_of(by_prompt),
        }
        return JSONResponse(body)

    def _echo_text(self, prompt: str | list[int], ids: list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)

    async def _completion_stream(
        self,
        rid: str,
        req: CompletionRequest,
        choices: list[Choice],
        echo: list[str],
        prompt_ids: list[list[int]],
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice: Choice, text: str, ids: list[int], lps: list, reason: str | None):
            entry: dict[str, Any] = {
                "index": choice.index,
                "text": text,
                "logprobs": None,
                "finish_reason": reason,
            }
            if req.logprobs is not None:
                body, offsets[choice.index] = completion_logprobs(
                    lps, self.texts, offsets[choice.index]
                )
                entry["logprobs"] = body
            if req.return_token_ids:
                entry["token_ids"] = ids
                if choice.index not in started:
                    entry["prompt_token_ids"] = prompt_ids[choice.prompt]
            started.add(choice.index)
            body_: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.config.model_name,
                "choices": [entry],
            }
            if with_usage:
                body_["usage"] = None
            return sse(body_)

        offsets = {c.index: 0 for c in choices}
        sent = {c.index: 0 for c in choices}
        started: set[int] = set()
        outputs: dict[int, RequestOutput] = {}
        try:
            if req.echo:
                for choice in choices:
                    yield chunk(choice, echo[choice.prompt], [], [], None)
            async for choice, event in self.merged_events(choices):
                if isinstance(event, Delta):
                    sent[choice.index] += len(event.token_ids)
                    yield chunk(
                        choice, event.text, list(event.token_ids), list(event.logprobs), None
                    )
                    continue
                outputs[choice.index] = event
                tail = sent[choice.index]
                yield chunk(
                    choice,
                    "",
                    event.token_ids[tail:],
                    (event.logprobs or [])[tail:],
                    FINISH_REASONS[event.finish_reason],
                )
            if with_usage:
                ordered = [outputs[c.index] for c in choices]
                by_prompt = [ordered[p * req.n : (p + 1) * req.n] for p in range(len(prompt_ids))]
                yield sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": self.config.model_name,
                        "choices": [],
                        "usage": usage_of(by_prompt),
                    }
                )
        except Exception as exc:
            yield sse(_as_api_error(exc).body())
        yield sse("[DONE]")

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card(n) for n in self.names]})

    async def model(self, request: Request) -> Response:
        self.check_auth(request)
        name = request.path_params["model"]
        self.check_model(name)
        return JSONResponse(self._model_card(name))

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixkv",
            "root": self.config.model_name,
            "max_model_len": self.engine.max_context,
        }

    async def tokenize(self, request: Request) -> Response:
        self.check_auth(request)
        req = protocol.decode_body(await request.body(), protocol.TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("prompt: give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            ids = self.engine.encode(protocol.conversation(req.messages), field="messages")
        else:
            if not isinstance(req.prompt, str):
                raise invalid(f"prompt: expected a string, got {type(req.prompt).__name__}")
            ids = self.engine.encode(req.prompt, field="prompt")
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_context}
        )

    async def detokenize(self, request: Request) -> Response:
        self.check_auth(request)
        req = protocol.decode_body(await request.body(), protocol.DetokenizeRequest)
        self.check_model(req.model)
        ids = self.engine.encode(req.tokens, field="tokens") if req.tokens else []
        return JSONResponse({"prompt": self.engine.tokenizer.decode(ids)})

    async def health(self, request: Request) -> Response:
        if not self.engine.alive:
            return engine_dead("the engine loop is not running").response()
        return JSONResponse({"status": "ok"})

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def _as_api_error(exc: BaseException) -> APIError:
    """Any failure as OpenAI's error: the engine's ValueErrors are the client's fault."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead(str(exc))
    if isinstance(exc, ValueError):
        return invalid(str(exc))
    log.error("request failed", exc_info=exc)
    return internal(f"the request failed: {type(exc).__name__}: {exc}")


def _endpoint(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            return _as_api_error(exc).response()

    return run


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = not_found(f"{request.url.path}: no such route", code="route_not_found")
    else:
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        error.type = "invalid_request_error"
    return error.response()


async def _unhandled(request: Request, exc: Exception) -> Response:
    return _as_api_error(exc).response()


def create_app(engine: Engine, config: ServerConfig | None = None) -> Starlette:
    """The OpenAI-compatible ASGI app over ``engine`` (serve it with uvicorn, or mount it)."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if config.close_engine_on_shutdown:
            await asyncio.to_thread(engine.close)

    routes = [
        Route("/v1/chat/completions", _endpoint(server.chat_completions), methods=["POST"]),
        Route("/v1/completions", _endpoint(server.completions), methods=["POST"]),
        Route("/v1/models", _endpoint(server.models), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint(server.model), methods=["GET"]),
        Route("/tokenize", _endpoint(server.tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(server.detokenize), methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.render_metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _unhandled},
        lifespan=lifespan,
    )
    app.state.server = server
    return app
