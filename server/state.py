"""What every endpoint shares: ``ServerState``, made once per app by ``create_app``.

The engine is held as an ``EngineClient``: an ``Engine`` in this process and a
``cluster.remote.RemoteEngine`` (replicas behind a router) look the same from here. Besides
the engine and the config it holds what must exist once per app, not per request: the
metrics registry, the token-text cache, the one tokenizing thread and the tasks that outlive
a request (observing the outputs of aborted requests).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from engine.api import EngineClient, PromptIds, RequestOutput
from server import access_log
from server.config import ServerConfig
from server.conversations.store import ConversationStore, store_path
from server.errors import invalid
from server.inspector.traffic import TrafficLog
from server.metrics import ServerMetrics
from server.responses.store import ResponseStore, StoreUnavailable, default_store_path
from server.tokens import TokenTexts

T = TypeVar("T")


class ServerState:
    """The engine, its names, metrics, token texts and the tokenizing thread."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine, config.model_name)
        self.traffic = TrafficLog()  # the inspector's last minutes
        self.texts = TokenTexts(engine.tokenizer)
        self.created = int(time.time())
        # Shutting down (replicas' SIGTERM): new requests get a 503, those in flight finish.
        self.draining = False
        # A text of more characters than this cannot fit the context whatever its tokens:
        # no token spells more than the vocabulary's longest entry.
        longest = max(map(len, engine.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = engine.max_context * max(longest, 1)
        # One worker: tokenizing and chat templating are slow for long texts and must not
        # hold the event loop (every stream and /health), and one tokenizer object is not
        # safe to share between threads.
        self._tokenize = concurrent.futures.ThreadPoolExecutor(1, "radixkv-tokenize")
        self._background: set[asyncio.Future[None]] = set()
        self.responses, self.conversations = open_stores(config)

    async def encode(
        self,
        prompt: Any,
        field: str,
        texts: Sequence[str],
        truncate_prompt_tokens: int | None = None,
        continuing: Sequence[int] | None = None,
    ) -> PromptIds:
        """``engine.encode`` off the event loop: the prompt's ids, checked once and cut to
        the client's ``truncate_prompt_tokens`` by the engine's rule, to be given to
        ``engine.submit`` as they are. First a length bound that needs no tokenizer:
        ``texts`` (the prompt's text parts) longer than any tokenization of the context are
        refused at once, so a few megabytes of text never occupy the tokenizing thread."""
        chars = sum(map(len, texts))
        if chars > self.max_prompt_chars:
            raise invalid(
                f"{field}: the maximum context length is {self.engine.max_context} "
                f"tokens, and {chars} characters of text cannot fit it; shorten it",
                param=field,
                code="context_length_exceeded",
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize,
            functools.partial(
                self.engine.encode, prompt, field=field,
                truncate_prompt_tokens=truncate_prompt_tokens, continuing=continuing,
            ),
        )

    async def decode(self, ids: list[int], field: str) -> str:
        """The text of ``ids`` (checked against the vocabulary: a 400 naming ``field``), on
        the tokenizing thread: a body of millions of ids takes seconds to decode."""

        def decode() -> str:
            return self.engine.tokenizer.decode(self.engine.encode(ids, field=field)) if ids else ""

        return await asyncio.get_running_loop().run_in_executor(self._tokenize, decode)

    async def on_tokenizer(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` on the tokenizing thread (the one thread that may use the
        tokenizer), awaited without holding the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize, functools.partial(call, *args)
        )

    def observe(self, output: RequestOutput) -> None:
        """One finished engine request, seen once: the metrics and the request's access
        line count its tokens."""
        self.metrics.observe(output)
        self.traffic.observe(output)
        access_log.count(completion=len(output.token_ids))

    def in_background(self, coroutine: Awaitable[None]) -> None:
        """Runs ``coroutine`` as a task held until it ends (asyncio keeps only weak
        references to tasks, so an unheld one may vanish half-way)."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def open_stores(config: ServerConfig) -> tuple[ResponseStore, ConversationStore]:
    """The stored conversations of /v1/responses (SQLite, durable unless ":memory:") and
    /v1/conversations' beside them, with the same tenancy. StoreUnavailable (the file and
    why) when either cannot be opened: ``radixkv serve`` checks this before loading a model."""
    responses_path = config.response_store or default_store_path()
    responses = ResponseStore(
        responses_path, config.response_store_max, config.response_store_bytes,
    )
    try:
        conversations = ConversationStore(store_path(str(responses_path)))
    except StoreUnavailable:
        responses.close()
        raise
    return responses, conversations
