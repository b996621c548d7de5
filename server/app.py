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
import concurrent.futures
import contextlib
import functools
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine import Engine, RequestOutput
from engine.model.sampler import TokenLogprob
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
    too_large,
    unauthorized,
)
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import ChatRequest, CompletionRequest
from server.responses import chat_logprobs, completion_logprobs, sse, usage_of
from server.tokens import TokenTexts

log = logging.getLogger("radixkv.server")

MAX_BODY_BYTES = 4 << 20
MAX_CHOICES = 256

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
    extra_model_names: list[str] = field(default_factory=list)
    # Bodies over this many bytes get 413 before they are parsed (OpenAI's own limit is
    # larger, but no prompt that fits this model's context comes near it).
    max_body_bytes: int = MAX_BODY_BYTES
    # Engine requests (prompts x n) one HTTP request may add: 400 beyond it.
    max_choices: int = MAX_CHOICES


# envelope(usage=NO_USAGE) leaves the key out (chunks of a stream without include_usage).
NO_USAGE = object()
RequestT = TypeVar("RequestT", ChatRequest, CompletionRequest)


@dataclass
class Choice:
    """One engine request of an API request: choice ``index``, on prompt ``prompt``."""

    index: int
    prompt: int
    handle: RequestHandle


@dataclass
class Update:
    """New text and tokens of one choice of a stream; ``output`` is set on its last update."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    output: RequestOutput | None = None


def _by_prompt(outputs: list[RequestOutput], n: int) -> list[list[RequestOutput]]:
    """Outputs in choice order, grouped by prompt (choice p * n + j is prompt p's j-th)."""
    return [outputs[i : i + n] for i in range(0, len(outputs), n)]


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
        # A text of more characters than this cannot fit the context whatever its tokens:
        # no token spells more than the vocabulary's longest entry.
        longest = max(map(len, engine.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = engine.max_context * max(longest, 1)
        # One worker: tokenizing and chat templating are slow for long texts and must not
        # hold the event loop (every stream and /health), and one tokenizer object is not
        # safe to share between threads.
        self._tokenize = concurrent.futures.ThreadPoolExecutor(1, "radixkv-tokenize")

    async def read_body(self, request: Request) -> bytes:
        """The body, or 413 past ``max_body_bytes`` (by its Content-Length when it has one,
        else while it streams in)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        size = int(declared) if declared.isdigit() else 0
        chunks = []
        if size <= limit:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
        if size > limit:
            raise too_large(
                f"the request body is over {limit} bytes (the server's --max-body-bytes)"
            )
        return b"".join(chunks)

    async def encode(self, prompt: Any, field: str, texts: list[str]) -> list[int]:
        """``engine.encode`` off the event loop, after a length check that needs no
        tokenizer: ``texts`` (the prompt's text parts) longer than any tokenization of the
        context are refused at once."""
        chars = sum(map(len, texts))
        if chars > self.max_prompt_chars:
            raise invalid(
                f"{field}: this model's maximum context length is {self.engine.max_context} "
                f"tokens, and {chars} characters of text cannot fit it; shorten it",
                param=field,
                code="context_length_exceeded",
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize, functools.partial(self.engine.encode, prompt, field=field)
        )

    # -------------------------------------------------------------------------- checks

    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # bytes: compare_digest refuses str with non-ASCII characters (a header can hold them)
        sent = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, key.encode("utf-8")):
            raise unauthorized()

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise not_found(
                f"model: {model!r} does not exist; this server serves {self.names}",
                param="model",
                code="model_not_found",
            )

    def check_queue(self, adding: int) -> None:
        """Room for ``adding`` engine requests (prompts x n): a 400 if one HTTP request asks
        for more than any may, a 503 + Retry-After while the queue has no room for them."""
        if adding > self.config.max_choices:
            raise invalid(
                f"n: {adding} completions (prompts x n) in one request; at most "
                f"{self.config.max_choices}",
                param="n",
            )
        limit = self.config.max_queued
        if limit is None:
            return
        if adding > limit:
            raise invalid(
                f"n: {adding} completions (prompts x n) in one request can never wait in "
                f"this server's queue of {limit} (--max-queued); send fewer at a time",
                param="n",
            )
        waiting = self.engine.num_waiting()
        if waiting + adding > limit:
            self.metrics.reject("queue_full")
            raise overloaded(
                f"the server is busy: {waiting} requests already wait and the queue holds "
                f"{limit} (--max-queued); retry later"
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
        self.check_queue(len(prompts) * len(params))
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

    async def updates(self, choices: list[Choice]) -> AsyncIterator[Update]:
        """Every choice's new text and tokens as they come, interleaved; a choice's last update
        carries its finish reason, the tokens no delta carried (a stop token) and its output.
        Leaving early (a disconnect cancels the stream) aborts every choice."""
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
        try:
            while len(ended) < len(choices):
                choice, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Delta):
                    sent[choice.index] += len(item.token_ids)
                    yield Update(choice, item.text, list(item.token_ids), list(item.logprobs))
                    continue
                ended.add(choice.index)
                self.metrics.observe(item)
                tail = sent[choice.index]
                yield Update(choice, "", item.token_ids[tail:], (item.logprobs or [])[tail:], item)
        finally:
            for task in tasks:
                task.cancel()
            rest = [c for c in choices if c.index not in ended]
            for choice in rest:
                choice.handle.abort()
            if rest:
                self._in_background(self._observe_aborted(rest))

    def parse(self, request: Request, body: bytes, kind: type[RequestT]) -> RequestT:
        """Auth, the body as ``kind``, and the checks both generation endpoints share."""
        self.check_auth(request)
        req = protocol.decode_body(body, kind)
        self.check_model(req.model)
        protocol.check_unsupported(req)
        protocol.check_token_ids(req.stop_token_ids, self.engine.model_config.vocab_size)
        return req

    def envelope(
        self, rid: str, obj: str, created: int, items: list[dict[str, Any]], usage: Any
    ) -> dict[str, Any]:
        """A response or stream chunk around its choices; ``usage`` NO_USAGE leaves it out."""
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.config.model_name,
            "choices": items,
        }
        if usage is not NO_USAGE:
            body["usage"] = usage
        return body

    # ------------------------------------------------------------------------ endpoints

    async def chat_completions(self, request: Request) -> Response:
        req = self.parse(request, await self.read_body(request), ChatRequest)
        protocol.check_chat_only(req)
        messages = protocol.conversation(req.messages)
        ids = await self.encode(messages, "messages", [m["content"] for m in messages])
        if req.max_completion_tokens is not None:
            name, asked = "max_completion_tokens", req.max_completion_tokens
        else:
            name, asked = "max_tokens", req.max_tokens
        budget = self.max_tokens(
            protocol.requested_max_tokens(name, asked), name, len(ids), "messages"
        )
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = [protocol.sampling_params(req, budget, top, j) for j in range(req.n)]
        choices = self.submit([ids], params, req.cache_salt, req.stream)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return EventStreamResponse(self._chat_stream(rid, req, choices))
        outputs = await self.wait(request, choices)
        if outputs is None:
            return Response(status_code=499)  # nobody is there to read it
        items = [
            self._chat_item(
                req,
                c,
                {"role": "assistant", "content": o.text},
                o.token_ids,
                o.logprobs or [],
                o.finish_reason,
                key="message",
            )
            for c, o in zip(choices, outputs)
        ]
        body = self.envelope(rid, "chat.completion", int(time.time()), items, usage_of([outputs]))
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return JSONResponse(body)

    def _chat_item(
        self,
        req: ChatRequest,
        choice: Choice,
        message: dict[str, str],
        ids: list[int],
        lps: list[TokenLogprob],
        reason: str | None,
        key: str = "delta",
    ) -> dict[str, Any]:
        item: dict[str, Any] = {
            "index": choice.index,
            key: message,
            "logprobs": chat_logprobs(lps, self.texts) if req.logprobs else None,
            "finish_reason": reason,
        }
        if req.return_token_ids:
            item["token_ids"] = ids
        return item

    async def _chat_stream(
        self, rid: str, req: ChatRequest, choices: list[Choice]
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        with_usage = bool(req.stream_options and req.stream_options.include_usage)
        per_chunk = None if with_usage else NO_USAGE  # OpenAI: "usage": null on every chunk

        def chunk(item: dict[str, Any]) -> bytes:
            return sse(self.envelope(rid, "chat.completion.chunk", created, [item], per_chunk))

        outputs: list[RequestOutput] = []
        try:
            for choice in choices:
                role = {"role": "assistant", "content": ""}
                yield chunk(self._chat_item(req, choice, role, [], [], None))
            async for u in self.updates(choices):
                delta = {"content": u.text} if u.output is None else {}
                reason = None if u.output is None else u.output.finish_reason
                yield chunk(self._chat_item(req, u.choice, delta, u.token_ids, u.logprobs, reason))
                if u.output is not None:
                    outputs.append(u.output)
            if with_usage:
                usage = usage_of([outputs])
                yield sse(self.envelope(rid, "chat.completion.chunk", created, [], usage))
        except Exception as exc:  # in-band: the status line is long gone
            yield sse(_as_api_error(exc).body())
        yield sse("[DONE]")

    async def completions(self, request: Request) -> Response:
        req = self.parse(request, await self.read_body(request), CompletionRequest)
        protocol.check_completion_only(req)
        prompts = protocol.completion_prompts(req.prompt)
        fields = [f"prompt[{i}]" if len(prompts) > 1 else "prompt" for i in range(len(prompts))]
        token_ids = [
            await self.encode(p, f, [p] if isinstance(p, str) else [])
            for p, f in zip(prompts, fields)
        ]
        asked = protocol.requested_max_tokens("max_tokens", req.max_tokens)
        if asked is None:
            asked = COMPLETIONS_DEFAULT_MAX_TOKENS
        budget = min(
            self.max_tokens(asked, "max_tokens", len(ids), field)
            for ids, field in zip(token_ids, fields)
        )
        params = [protocol.sampling_params(req, budget, req.logprobs, j) for j in range(req.n)]
        echo = [self._echo_text(p, ids) if req.echo else "" for p, ids in zip(prompts, token_ids)]
        choices = self.submit(token_ids, params, req.cache_salt, req.stream)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return EventStreamResponse(self._completion_stream(rid, req, choices, echo, token_ids))
        outputs = await self.wait(request, choices)
        if outputs is None:
            return Response(status_code=499)
        items = []
        for choice, out in zip(choices, outputs):
            item = self._completion_item(
                req,
                choice,
                echo[choice.prompt] + out.text,
                out.token_ids,
                out.logprobs or [],
                0,
                out.finish_reason,
            )[0]
            if req.return_token_ids:
                item["prompt_token_ids"] = token_ids[choice.prompt]
            items.append(item)
        usage = usage_of(_by_prompt(outputs, req.n))
        return JSONResponse(self.envelope(rid, "text_completion", int(time.time()), items, usage))

    def _completion_item(
        self,
        req: CompletionRequest,
        choice: Choice,
        text: str,
        ids: list[int],
        lps: list[TokenLogprob],
        offset: int,
        reason: str | None,
    ) -> tuple[dict[str, Any], int]:
        """A completion choice, and the text offset after its tokens (a stream goes on there)."""
        item: dict[str, Any] = {
            "index": choice.index,
            "text": text,
            "logprobs": None,
            "finish_reason": reason,
        }
        if req.logprobs is not None:
            item["logprobs"], offset = completion_logprobs(lps, self.texts, offset)
        if req.return_token_ids:
            item["token_ids"] = ids
        return item, offset

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
        per_chunk = None if with_usage else NO_USAGE
        offsets = {c.index: 0 for c in choices}
        started: set[int] = set()

        def chunk(choice: Choice, text: str, ids: list[int], lps: list, reason: str | None):
            item, offsets[choice.index] = self._completion_item(
                req, choice, text, ids, lps, offsets[choice.index], reason
            )
            if req.return_token_ids and choice.index not in started:
                item["prompt_token_ids"] = prompt_ids[choice.prompt]
            started.add(choice.index)
            return sse(self.envelope(rid, "text_completion", created, [item], per_chunk))

        outputs: dict[int, RequestOutput] = {}
        try:
            if req.echo:
                for choice in choices:
                    yield chunk(choice, echo[choice.prompt], [], [], None)
            async for u in self.updates(choices):
                reason = None if u.output is None else u.output.finish_reason
                yield chunk(u.choice, u.text, u.token_ids, u.logprobs, reason)
                if u.output is not None:
                    outputs[u.choice.index] = u.output
            if with_usage:
                usage = usage_of(_by_prompt([outputs[c.index] for c in choices], req.n))
                yield sse(self.envelope(rid, "text_completion", created, [], usage))
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
        req = protocol.decode_body(await self.read_body(request), protocol.TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("prompt: give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            messages = protocol.conversation(req.messages)
            ids = await self.encode(messages, "messages", [m["content"] for m in messages])
        else:
            if not isinstance(req.prompt, str):
                raise invalid(f"prompt: expected a string, got {type(req.prompt).__name__}")
            ids = await self.encode(req.prompt, "prompt", [req.prompt])
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_context}
        )

    async def detokenize(self, request: Request) -> Response:
        self.check_auth(request)
        req = protocol.decode_body(await self.read_body(request), protocol.DetokenizeRequest)
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
    # The details stay in the log: an exception's text can carry internals (paths, Ray's
    # actor ids and node addresses) that a client must not see.
    return internal("the request failed inside the server (its log has the details); retry")


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
    return error.response()


async def _unhandled(request: Request, exc: Exception) -> Response:
    return _as_api_error(exc).response()


def create_app(engine: Engine, config: ServerConfig | None = None) -> Starlette:
    """The OpenAI-compatible ASGI app over ``engine`` (serve it with uvicorn, or mount it)."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)

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
    )
    app.state.server = server
    return app
