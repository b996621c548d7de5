"""The public Engine: prompts in, RequestOutputs out, from any thread or event loop."""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from engine.api import (
    EngineDeadError,
    EngineStats,
    PrefixPin,
    PromptIds,
    RequestHandle,
    RequestOutput,
    TextStream,
    abort_on_exit,
    check_pin_ttl,
)
from engine.api.handle import outputs_or_raise
from engine.api.inspector import InspectSnapshot
from engine.config import EngineConfig
from engine.serving.assembly import assemble
from engine.serving.commands import Inspect, PinPrefix, Submit, Unpin, UnpinPrefix
from engine.serving.inputs import check_params, is_conversation, split_prompts
from engine.serving.job import Job
from engine.serving.tools import CONVERSATIONS_ONLY, ToolFormat, ToolUse, tool_format_for
from radix import KVEvent
from scheduler import Request, SamplingParams

if TYPE_CHECKING:
    from engine.serving.chat import ChatSession

ParamsArg = SamplingParams | Sequence[SamplingParams] | None


class Engine:
    """A prefix-caching inference engine over one model.

    A background thread runs the model; every method here may be called from any thread
    (``generate``, ``stream``) or event loop (``agenerate``, ``astream``) concurrently.
    Requests sharing a prefix share its KV: ``RequestOutput.cached_tokens`` says how much of a
    prompt was served from the cache.

    Built from an ``EngineConfig`` (``engine.config``: every knob, documented there), with
    ``overrides`` by plain knob name: ``Engine(page_size=32, num_pages=512)`` or
    ``Engine(config, dtype="float32")``. ``model`` may also be (advanced) an already loaded
    ``LoadedModel``, which is then shared, not copied (``device``/``dtype`` are the loaded
    model's). ``prefix_cache=False`` reuses nothing across requests (the benchmarks'
    baseline). With ``batch_invariant`` (the CPU's default) every greedy answer is
    independent of the batch it ran in, the cache (hit, miss, partial), prefill chunking,
    preemption, cascade decode and the page size, in float32 and bfloat16 alike, as the dtype
    probe verified on this machine (``Engine.batch_invariant`` says whether it did).
    Implements ``engine.api.EngineClient``.
    """

    def __init__(self, config: EngineConfig | None = None, /, **overrides: Any) -> None:
        self._parts = assemble(config, overrides)  # engine.serving.assembly builds it all
        self._loop = self._parts.loop
        self._inbox = self._loop.inbox  # commands for the loop's thread
        self._inputs = self._parts.inputs
        self._pool_tokens = self._parts.num_pages * self._parts.config.page_size
        self._request_ids = itertools.count()
        # Closes the loop (and frees the pool) if the engine is dropped without close().
        self._finalizer = weakref.finalize(self, self._loop.close)
        self._closing = threading.Lock()

    # ------------------------------------------------------------------------------ properties

    @property
    def speculation(self) -> str:
        """The speculative decoding in effect: "tree" or "off" (see ``EngineConfig``)."""
        return self._parts.scheduler_config.speculation

    @property
    def tokenizer(self) -> Any:
        return self._parts.tokenizer

    @property
    def model_config(self) -> Any:
        return self._parts.model_config

    @property
    def tool_format(self) -> ToolFormat:
        """How this engine's model writes tools and calls: the format its chat template was
        trained on (Hermes / Qwen's ``<tool_call>``), else radixkv's own."""
        return tool_format_for(getattr(self._parts.tokenizer, "chat_template", None))

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens one request may hold: the model's context, or less where
        the KV pool holds fewer (the last generated token is never stored)."""
        return self._inputs.context(self._pool_tokens)

    @property
    def config(self) -> EngineConfig:
        """The knobs this engine was built with."""
        return self._parts.config

    @property
    def page_size(self) -> int:
        return self._parts.config.page_size

    @property
    def prefix_cache(self) -> bool:
        """False: nothing is reused across requests (the benchmarks' baseline)."""
        return self._parts.config.prefix_cache

    @property
    def num_pages(self) -> int:
        return self._parts.num_pages

    @property
    def device(self) -> torch.device:
        return self._parts.device

    @property
    def batch_invariant(self) -> bool:
        """True when greedy answers cannot depend on the batch, the cache or the page size."""
        return self._parts.batch_invariant

    @property
    def dtype(self) -> torch.dtype:
        return self._parts.dtype

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (asked for, captured, and as exact as the
        eager passes by the start-up check)."""
        return self._parts.cuda_graphs

    @property
    def attention_kernel(self) -> str:
        """Which attention runs: ``"native"`` (the compiled batch-invariant kernel), ``"torch"``
        (its torch version, where the kernel cannot be built) or ``"fast"`` (not invariant)."""
        return self._parts.attention_kernel

    # ------------------------------------------------------------------------------ generation

    def submit(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        namespace: str | None = None,
        stream: bool = False,
        pin_ttl: float | None = None,
    ) -> RequestHandle:
        """Queues one request and returns its handle at once: every other way in builds on it.

        ``prompt``: a str, a list of token ids, a conversation ``[{"role", "content"}, ...]``
        (rendered with the chat template), or ``PromptIds`` from ``encode`` (not encoded or
        checked again). Everything is validated here, in the caller's
        thread: a bad request raises ValueError and nothing is queued. With ``stream=True``
        iterating the handle yields text deltas before the RequestOutput. ``handle.result()``
        (or ``await handle.aresult()``) waits for the output; ``handle.abort()`` stops it.
        ``pin_ttl``: once the request finishes, its prompt and output stay pinned in the pool
        for that many seconds (as ``pin`` does): a conversation's next turn finds them.
        """
        [(ids, p)] = self._prepare(prompt, params, namespace, single=True)
        return self._submit_ids(ids, p, namespace, stream, check_pin_ttl(pin_ttl, "pin_ttl"))

    def pin(
        self, prompt: Any, *, ttl: float, namespace: str | None = None,
        timeout: float | None = 30.0,
    ) -> PrefixPin:
        """Keep the cached part of ``prompt`` (as for ``submit``; ``namespace`` as the requests
        that cached it) in the KV pool for ``ttl`` seconds: other traffic cannot evict it.
        Returns a ``PrefixPin`` whose ``tokens`` is how much was cached and pinned (0: none)
        and whose ``unpin()`` ends it early. Pins share a budget, ``max_pinned_fraction`` of
        the pool: past it the oldest pin of the namespace pinning the most ends first (one
        tenant's pins never end another's). An ended pin's pages are ordinary
        cached pages again (written down to the KV tiers when evicted, where there are
        tiers)."""
        [(ids, _)] = self._prepare(prompt, None, namespace, single=True)
        order = PinPrefix(list(ids), namespace, check_pin_ttl(ttl, required=True))
        self._inbox.post(order)
        pin = order.answer.result(timeout)
        if pin is None or not pin.active:  # nothing cached, or alone over the budget
            return PrefixPin(0, 0.0, None)
        return PrefixPin(pin.length, pin.expires, lambda: self._inbox.post(Unpin(pin)))

    def unpin_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> None:
        """End the pins of ``namespace`` on the path of ``token_ids`` (those ``submit``'s
        ``pin_ttl`` took for a conversation now deleted); returns at once."""
        self._inbox.post(UnpinPrefix(list(token_ids), namespace))

    def generate(
        self,
        prompts: Any,
        params: ParamsArg = None,
        namespace: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; returns their outputs in input order (always a list).

        ``prompts``: one prompt (as for ``submit``) or a list of them. ``params``: one
        SamplingParams for all, or one per prompt. If a request fails, the others still run
        to completion and then the first error is raised. ``tools`` (OpenAI's list of
        functions; conversations only) are offered to the model in radixkv's tool format
        (``engine.serving.tools``); ``tool_choice`` is "auto" (default), "none", "required"
        or ``{"type": "function", "function": {"name": ...}}``; a reply that calls them has
        ``tool_calls`` and finish_reason "tool_calls".
        """
        if tools is not None or tool_choice is not None:
            tool_use = ToolUse.offered(tools, tool_choice, tool_format=self.tool_format)
            assert tool_use is not None
            return self._generate_with_tools(prompts, params, namespace, tool_use)
        return self._run_all(self._prepare(prompts, params, namespace), namespace)

    def _run_all(
        self, prepared: list[tuple[list[int], SamplingParams]], namespace: str | None
    ) -> list[RequestOutput]:
        """Submits every prepared request, waits for all; the first error is raised once the
        others have finished."""
        handles: list[RequestHandle] = []
        with abort_on_exit(handles):  # interrupted (KeyboardInterrupt) or a submit failed
            for ids, p in prepared:
                handles.append(self._submit_ids(ids, p, namespace))
            events = [handle.final_event() for handle in handles]
        return outputs_or_raise(events)

    def _generate_with_tools(
        self, prompts: Any, params: ParamsArg, namespace: str | None, tool_use: ToolUse
    ) -> list[RequestOutput]:
        items = split_prompts(prompts)
        if not all(is_conversation(p) for p in items):
            raise ValueError(CONVERSATIONS_ONLY)
        checked = check_params(params, len(items), self._inputs.vocab_size)
        prepared = [tool_use.prepare(m, p.structured_outputs) for m, p in zip(items, checked)]
        outs = self.generate(
            [prompt.messages for prompt in prepared],
            [prompt.constrained(p) for prompt, p in zip(prepared, checked)],
            namespace,
        )
        return [tool_use.parse(o) for o in outs]

    def stream(
        self, prompt: Any, params: SamplingParams | None = None, namespace: str | None = None
    ) -> TextStream:
        """Yields text deltas (str) as they are generated, then the final RequestOutput.

        The deltas concatenate to ``RequestOutput.text``. The request is submitted on the first
        ``next()``. ``close()`` (from any thread) aborts it and frees its pages, as does
        dropping the stream before its end; a ``break`` alone leaves it running while the
        stream is still referenced (a ``TextStream``; ``submit`` gives a handle to abort).
        """
        [(ids, p)] = self._prepare(prompt, params, namespace, single=True)
        return TextStream(lambda: self._submit_ids(ids, p, namespace, stream=True))

    async def agenerate(
        self, prompts: Any, params: ParamsArg = None, namespace: str | None = None
    ) -> list[RequestOutput]:
        """``generate`` for asyncio: awaits without blocking the event loop. Cancelling the
        awaiting task aborts the requests."""
        prepared = self._prepare(prompts, params, namespace)
        handles = [self._submit_ids(ids, p, namespace) for ids, p in prepared]
        with abort_on_exit(handles):  # cancelled: abort what has not finished
            events = await asyncio.gather(*(h.afinal_event() for h in handles))
        return outputs_or_raise(list(events))

    async def astream(
        self, prompt: Any, params: SamplingParams | None = None, namespace: str | None = None
    ) -> AsyncIterator[str | RequestOutput]:
        """``stream`` for asyncio: ``async for`` yields text deltas, then the RequestOutput.
        Cancelling the consuming task or ``aclose()`` aborts the request."""
        [(ids, p)] = self._prepare(prompt, params, namespace, single=True)
        events = self._submit_ids(ids, p, namespace, stream=True).__aiter__()
        try:
            async for item in events:
                yield item
        finally:
            await events.aclose()  # aborts the request unless it ended

    def fork(
        self,
        prefix: str | Sequence[int],
        suffixes: Sequence[str | Sequence[int]],
        params: ParamsArg = None,
        namespace: str | None = None,
    ) -> list[RequestOutput]:
        """Continues one prefix with each suffix; the prefix's KV is computed once and shared.

        The prefix and each suffix are tokenised separately and concatenated as token ids, so
        every request starts with exactly the prefix's tokens. All requests are submitted
        together; the scheduler runs the first prefill and holds back the others until the
        prefix is cached, then they hit it.
        """
        self._raise_if_closed()
        prepared = self._inputs.prepare_fork(
            prefix, suffixes, params, namespace, self._pool_tokens
        )
        return self._run_all(prepared, namespace)

    def chat(
        self,
        system: str | None = None,
        params: SamplingParams | None = None,
        namespace: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> ChatSession:
        """A multi-turn chat session; each turn reuses the KV of the conversation so far.
        With ``tools`` every turn may call them (``session.last_output.tool_calls``); a
        tool's result goes back with ``session.send(result, role="tool")``."""
        from engine.serving.chat import ChatSession

        return ChatSession(
            self, system=system, params=params, namespace=namespace, tools=tools,
            tool_choice=tool_choice,
        )

    def encode(
        self,
        prompt: Any,
        field: str = "prompt",
        truncate_prompt_tokens: int | None = None,
        continuing: Sequence[int] | None = None,
    ) -> PromptIds:
        """The token ids ``submit`` would run for ``prompt`` (a conversation rendered with the
        chat template), checked the same way; ValueError names ``field``. ``submit`` takes
        them back without encoding or checking them again. ``truncate_prompt_tokens`` keeps
        their tail as ``SamplingParams.truncate_prompt_tokens`` would (the same rule, the
        same context): for a caller that needs the kept ids before it makes the params."""
        self._raise_if_closed()
        return self._inputs.encode(
            prompt, field, truncate_prompt_tokens, self._pool_tokens, continuing
        )

    # ------------------------------------------------------------------------- state, shutdown

    @property
    def alive(self) -> bool:
        """True while the engine loop runs (False once it died or the engine was closed)."""
        return not self.closed and self._loop.alive

    def subscribe_kv(self, listener: Callable[[KVEvent], None]) -> None:
        """Call ``listener`` with every ``PagesStored``/``PagesEvicted`` of this engine's KV
        pool from now on, and with KV tiers every ``TierChanged`` of host memory and disk
        (first what they hold already), on the engine loop's thread (keep it short). A
        replica's KV-event publisher follows the cache this way; subscribe before serving
        anything."""
        self._loop.subscribe_kv(listener)

    def num_waiting(self) -> int:
        """Requests submitted and not yet running (what a server's queue limit counts)."""
        return self._loop.num_waiting()

    def stats(self) -> EngineStats:
        """Monotone counters (requests, prompt/cached/computed/generated tokens, evicted pages,
        preemptions), the hit rate derived from them, the current page accounting, and whether
        this engine's greedy answers are verified batch-invariant."""
        stats = self._loop.stats()
        return msgspec.structs.replace(stats, batch_invariant=self._parts.batch_invariant)

    def inspect(self, budget: int = 400, timeout: float | None = 30.0) -> InspectSnapshot:
        """What the cache holds now, for the inspector: at most ``budget`` tree nodes
        (breadth first, summarised below), the last admitted requests with why the rest of
        each prompt was computed, and the stats, all taken on the loop thread between
        passes (``InspectSnapshot.loop_s``: how long that took). Waits at most ``timeout``
        seconds for the loop (a pass in progress finishes first)."""
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"budget: must be an int >= 0, got {budget!r}")
        order = Inspect(budget)
        self._inbox.post(order)
        return order.answer.result(timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no request is queued or running (and the page accounting was checked);
        False on timeout."""
        return self._loop.wait_idle(timeout)

    def close(self) -> None:
        """Aborts what is in flight, stops the loop thread and frees the KV cache. Every caller
        returns only once that is done, not only the first: a server's shutdown timer and its
        main thread may both close, and a process that exits while the loop is still mid-pass
        on another thread dies in torch's teardown (SIGABRT)."""
        with self._closing:
            self._finalizer()
        self._parts.platform.release_cached_memory()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------- internal

    def _raise_if_closed(self) -> None:
        if self.closed:
            raise EngineDeadError("the engine is closed")

    def _prepare(
        self, prompts: Any, params: Any, namespace: Any, single: bool = False
    ) -> list[tuple[list[int], SamplingParams]]:
        """Tokenises and validates everything before anything is queued: the one boundary
        (``engine.serving.inputs``)."""
        self._raise_if_closed()
        return self._inputs.prepare(prompts, params, namespace, self._pool_tokens, single)

    def _submit_ids(
        self,
        token_ids: list[int],
        params: SamplingParams,
        namespace: str | None,
        stream: bool = False,
        pin_ttl: float | None = None,
    ) -> RequestHandle:
        """Queues validated token ids (from ``_prepare``)."""
        request = Request(
            next(self._request_ids), token_ids, params, namespace, self._parts.eos_token_ids
        )
        job, handle = Job.open(request, self._parts.tokenizer, self._inbox.abort, stream, pin_ttl)
        self._inbox.post(Submit(job))
        return handle
