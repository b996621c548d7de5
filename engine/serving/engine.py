"""The public Engine: prompts in, RequestOutputs out, from any thread or event loop."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import warnings
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
    context_limit,
)
from engine.api.handle import outputs_or_raise
from engine.api.inspector import InspectSnapshot
from engine.config import EngineConfig
from engine.model.bringup.build import (
    build_platform,
    build_pool,
    build_runner,
    verified_invariant,
    warn_if_slow_dtype,
)
from engine.model.bringup.load import load_model
from engine.model.loader import LoadedModel
from engine.model.structured import Grammars
from engine.serving.detokenizer import IncrementalDetokenizer
from engine.serving.inspector import InspectOrder
from engine.serving.kv_tiers import build_tiers
from engine.serving.loop import EngineLoop, Job, PinOrder
from engine.serving.prompts import PromptPreparer, encode_prompt, encode_text, split_prompts
from engine.serving.tools import CONVERSATIONS_ONLY, ToolUse
from engine.serving.validation import check_token_ids
from radix import KVEvent, KVManager
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from engine.serving.chat import ChatSession

ParamsArg = SamplingParams | Sequence[SamplingParams] | None


log = logging.getLogger("radixkv.engine")


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
        model = overrides.get("model")
        loaded_model = model if isinstance(model, LoadedModel) else None
        if loaded_model is not None:
            overrides["model"] = None
        # Every knob is checked here, before the (slow) model load.
        config = (config or EngineConfig()).replace(**overrides)
        self._engine_config = config
        loaded = loaded_model or load_model(config.model, config.device, config.dtype)
        self._platform = platform = build_platform(loaded, config)
        warn_if_slow_dtype(platform, loaded.dtype)
        self._tokenizer = loaded.tokenizer
        self._config = loaded.config
        grammars = Grammars(loaded.tokenizer)  # structured outputs: checked here, masked there
        self._prompts = PromptPreparer(
            loaded.tokenizer, loaded.config.vocab_size, int(loaded.config.max_position_embeddings),
            grammars,
        )
        self._device = loaded.device
        self._dtype = loaded.dtype
        pool = build_pool(loaded, config, platform)
        tiers = build_tiers(loaded, pool, config, platform)
        kv = KVManager(
            pool.num_pages, config.page_size, config.prefix_cache, tiers,
            config.max_pinned_fraction,
        )
        runner = build_runner(loaded, pool, config, platform, grammars)
        self._batch_invariant = runner.batch_invariant and verified_invariant(
            loaded, config.batch_invariant, runner
        )
        self._attention_kernel = runner.backend.kernel_name
        self._cuda_graphs = runner.graphs is not None
        log.info(
            "engine on %s (%s): attention %s, cuda graphs %s, batch_invariant=%s",
            loaded.device, str(loaded.dtype).removeprefix("torch."), self._attention_kernel,
            "on" if runner.graphs is not None else "off", self._batch_invariant,
        )
        self._num_pages = kv.num_pages
        self._eos_token_ids = frozenset(loaded.config.eos_token_ids)
        self._request_ids = itertools.count()
        self._loop = EngineLoop(Scheduler(kv, self._scheduler_config(config)), runner)
        # Closes the loop (and frees the pool) if the engine is dropped without close().
        self._finalizer = weakref.finalize(self, self._loop.close)
        self._closing = threading.Lock()

    def _scheduler_config(self, config: EngineConfig) -> SchedulerConfig:
        """The scheduler's knobs, speculation and shared rows off where the passes are not
        batch-invariant: a verify pass or a follower's copied row then need not give the numbers
        plain decoding gives, and a greedy answer must never depend on either."""
        scheduler = config.scheduler
        if scheduler.speculation != "off" and not self._batch_invariant:
            warnings.warn(
                f"speculation={scheduler.speculation!r} needs batch-invariant passes, which "
                "this engine does not have (batch_invariant=False, or not verified on this "
                "machine): it is off",
                stacklevel=3,
            )
            scheduler = msgspec.structs.replace(scheduler, speculation="off")
        if not self._batch_invariant:  # a shared row is exact only if rows are invariant
            scheduler = msgspec.structs.replace(scheduler, share_rows=False)
        self._speculation = scheduler.speculation
        return scheduler

    # ------------------------------------------------------------------------------ properties

    @property
    def speculation(self) -> str:
        """The speculative decoding in effect: "tree" or "off" (see ``EngineConfig``)."""
        return self._speculation

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_config(self) -> Any:
        return self._config

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens one request may hold: the model's context, or less where
        the KV pool holds fewer (the last generated token is never stored)."""
        return context_limit(
            int(self._config.max_position_embeddings), self._num_pages * self.page_size
        )

    @property
    def config(self) -> EngineConfig:
        """The knobs this engine was built with."""
        return self._engine_config

    @property
    def page_size(self) -> int:
        return self._engine_config.page_size

    @property
    def prefix_cache(self) -> bool:
        """False: nothing is reused across requests (the benchmarks' baseline)."""
        return self._engine_config.prefix_cache

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def batch_invariant(self) -> bool:
        """True when greedy answers cannot depend on the batch, the cache or the page size."""
        return self._batch_invariant

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (asked for, captured, and as exact as the
        eager passes by the start-up check)."""
        return self._cuda_graphs

    @property
    def attention_kernel(self) -> str:
        """Which attention runs: ``"native"`` (the compiled batch-invariant kernel), ``"torch"``
        (its torch version, where the kernel cannot be built) or ``"fast"`` (not invariant)."""
        return self._attention_kernel

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
        return self._submit_ids(ids, p, namespace, stream, check_pin_ttl(pin_ttl))

    def pin(
        self, prompt: Any, *, ttl: float, namespace: str | None = None,
        timeout: float | None = 30.0,
    ) -> PrefixPin:
        """Keep the cached part of ``prompt`` (as for ``submit``; ``namespace`` as the requests
        that cached it) in the KV pool for ``ttl`` seconds: other traffic cannot evict it.
        Returns a ``PrefixPin`` whose ``tokens`` is how much was cached and pinned (0: none)
        and whose ``unpin()`` ends it early. Pins share a budget, ``max_pinned_fraction`` of
        the pool: past it the oldest pins end first. An ended pin's pages are ordinary
        cached pages again (written down to the KV tiers when evicted, where there are
        tiers)."""
        [(ids, _)] = self._prepare(prompt, None, namespace, single=True)
        order = PinOrder(list(ids), namespace, check_pin_ttl(ttl))
        self._loop.pin(order)
        pin = order.answer.result(timeout)
        if pin is None or not pin.active:  # nothing cached, or alone over the budget
            return PrefixPin(0, 0.0, None)
        return PrefixPin(pin.length, pin.expires, lambda: self._loop.unpin(pin))

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
        tool_use = ToolUse.offered(tools, tool_choice)
        if tool_use is not None:
            return self._generate_with_tools(prompts, params, namespace, tool_use)
        handles: list[RequestHandle] = []
        with abort_on_exit(handles):  # interrupted (KeyboardInterrupt) or a submit failed
            for ids, p in self._prepare(prompts, params, namespace):
                handles.append(self._submit_ids(ids, p, namespace))
            events = [handle.final_event() for handle in handles]
        return outputs_or_raise(events)

    def _generate_with_tools(
        self, prompts: Any, params: ParamsArg, namespace: str | None, tool_use: ToolUse
    ) -> list[RequestOutput]:
        items = split_prompts(prompts)
        if not all(isinstance(p, list) and p and isinstance(p[0], Mapping) for p in items):
            raise ValueError(CONVERSATIONS_ONLY)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(items)
        constrained = tool_use.constrain(params)
        conversations = [tool_use.render(m) for m in items]
        outs = self.generate(conversations, constrained, namespace)
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
        vocab = self._config.vocab_size
        if isinstance(prefix, str):
            if not prefix:
                raise ValueError("prefix: empty prefix; it needs at least one token")
            prefix_ids = check_token_ids(
                encode_text(self._tokenizer, prefix, field="prefix"), vocab, "prefix"
            )
        else:
            prefix_ids = encode_prompt(self._tokenizer, prefix, vocab, "prefix")
        if isinstance(suffixes, str) or not isinstance(suffixes, Sequence):
            raise ValueError("suffixes: expected a list of str or token-id lists")
        if len(suffixes) == 0:
            raise ValueError("suffixes: empty list; expected at least one suffix")
        prompts: list[list[int]] = []
        for i, suffix in enumerate(suffixes):
            if isinstance(suffix, str):
                ids = encode_text(
                    self._tokenizer, suffix, add_special_tokens=False, field=f"suffixes[{i}]"
                )
            elif isinstance(suffix, Sequence):
                ids = check_token_ids(suffix, vocab, f"suffixes[{i}]") if len(suffix) else []
            else:
                raise ValueError(
                    f"suffixes[{i}]: expected str or token ids, got {type(suffix).__name__}"
                )
            prompts.append(prefix_ids + ids)
        return self.generate(prompts, params, namespace)

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
        if self.closed:
            raise EngineDeadError("the engine is closed")
        return self._prompts.encode(
            prompt, field, truncate_prompt_tokens, self._num_pages * self.page_size, continuing
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
        return msgspec.structs.replace(self._loop.stats(), batch_invariant=self._batch_invariant)

    def inspect(self, budget: int = 400, timeout: float | None = 30.0) -> InspectSnapshot:
        """What the cache holds now, for the inspector: at most ``budget`` tree nodes
        (breadth first, summarised below), the last admitted requests with why the rest of
        each prompt was computed, and the stats, all taken on the loop thread between
        passes (``InspectSnapshot.loop_s``: how long that took). Waits at most ``timeout``
        seconds for the loop (a pass in progress finishes first)."""
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"budget: must be an int >= 0, got {budget!r}")
        order = InspectOrder(budget)
        self._loop.inspect(order)
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
        self._platform.release_cached_memory()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------- internal

    def _prepare(
        self, prompts: Any, params: Any, namespace: Any, single: bool = False
    ) -> list[tuple[list[int], SamplingParams]]:
        """Tokenises and validates everything before anything is queued: the one boundary."""
        if self.closed:
            raise EngineDeadError("the engine is closed")
        return self._prompts.prepare(
            prompts, params, namespace, self._num_pages * self.page_size, single
        )

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
            next(self._request_ids), token_ids, params, namespace, self._eos_token_ids
        )
        handle, sink = RequestHandle.open(request.id, self._loop.abort)
        detokenizer = IncrementalDetokenizer(
            self._tokenizer, stop=params.stop, prompt_ids=token_ids, min_tokens=params.min_tokens,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        self._loop.submit(Job(request, detokenizer, sink, stream, pin_ttl=pin_ttl))
        return handle
