"""The engine as its callers see it: ``EngineClient``; ``PromptIds``, a prompt encoded and
checked once; and ``context_limit``, the one rule for how many tokens a request may hold.

The HTTP server, ``ChatSession`` and the commands are written against this protocol; an
``Engine`` in this process and ``cluster.remote.RemoteEngine`` (replicas behind a router)
both implement it, so the server cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from engine.api.handle import RequestHandle
    from engine.api.stats import EngineStats
    from scheduler import SamplingParams


class PromptIds(list[int]):
    """A prompt's token ids as ``EngineClient.encode`` returned them: encoded and checked
    against the model's vocabulary. ``submit`` takes them without encoding or checking them
    again (only what depends on the request's parameters, the context and pool fit, is
    checked then). A list, so it compares, serialises and travels as one; whoever makes one
    by hand, or changes one, vouches for its ids."""

    __slots__ = ()


def context_limit(model_context: int | None, pool_tokens: int | None) -> int:
    """Prompt + generated tokens one request may hold: the model's context, or the KV pool's
    tokens + 1 where that is less (the last generated token is never fed back, so its K/V is
    never stored). A bound not known (None: a replica's pool before it reported) does not
    count; one of them must be known. Engine, RemoteEngine, submit's fit check and the
    server's error text all ask here, so they cannot disagree by one."""
    bounds = [b for b in (model_context, None if pool_tokens is None else pool_tokens + 1)
              if b is not None]
    if not bounds:
        raise ValueError("context_limit: neither the model's context nor the pool is known")
    return min(bounds)


@runtime_checkable
class EngineClient(Protocol):
    """What a front end needs of an engine."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def model_config(self) -> Any: ...

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens one request may hold (``context_limit``)."""
        ...

    @property
    def tool_format(self) -> Any:
        """How the model writes tools and calls (an ``engine.tools.ToolFormat``): the doors
        offer tools and render a conversation's earlier calls through it."""
        ...

    @property
    def alive(self) -> bool: ...

    def encode(
        self,
        prompt: Any,
        field: str = "prompt",
        truncate_prompt_tokens: int | None = None,
        continuing: Sequence[int] | None = None,
    ) -> PromptIds:
        """The checked token ids of one prompt (text, ids or chat messages), their last
        ``truncate_prompt_tokens`` (-1: ``max_context``); ValueError names ``field``.
        ``continuing``: an earlier turn's prompt + reply ids that the conversation
        ``prompt`` extends, kept verbatim where the rendered text agrees (cache hits)."""
        ...

    def submit(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        namespace: str | None = None,
        stream: bool = False,
        pin_ttl: float | None = None,
    ) -> RequestHandle:
        """Queues one request (a prompt, or ``PromptIds`` from ``encode``); returns at once.
        ``pin_ttl``: keep its prompt and output pinned in the KV pool of the engine that ran
        it for that many seconds after it finishes (a conversation's next turn)."""
        ...

    def unpin_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> None:
        """End the pins ``pin_ttl`` took on the path of ``token_ids`` in ``namespace`` (a
        stored conversation deleted); returns at once."""
        ...

    def num_waiting(self) -> int:
        """Requests submitted and not yet running: queued (what ``--max-queued`` counts)."""
        ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
