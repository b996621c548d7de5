"""The public Engine: prompts in, RequestOutputs out, from any thread or event loop."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.model.attention import BACKENDS
from engine.model.kv_pool import KVPool
from engine.model.loader import LoadedModel, load_model
from engine.model.machine import available_memory_bytes, machine_memory_bytes
from engine.model.runner import ModelRunner
from engine.model.threads import ThreadPolicy
from engine.serving.detokenizer import IncrementalDetokenizer
from engine.serving.errors import EngineDeadError
from engine.serving.handle import RequestHandle, TextStream, outputs_or_raise
from engine.serving.kv_tiers import build_tiers, check_tier_args
from engine.serving.loop import EngineLoop, Job
from engine.serving.outputs import RequestOutput
from engine.serving.prompts import encode_one, encode_prompt, encode_text, prepare_prompts
from engine.serving.stats import EngineStats
from engine.serving.validation import check_token_ids
from radix import KVEvent, KVManager
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from engine.serving.chat import ChatSession

# Default KV budget on the CPU: 1 GiB (about 23k tokens of SmolLM2-135M in float32), or an
# eighth of the machine's memory when that is smaller. On CUDA: a share of the free memory
# after the weights are loaded.
CPU_KV_BYTES = 1 << 30
CUDA_KV_FRACTION = 0.7

ParamsArg = SamplingParams | Sequence[SamplingParams] | None


class Engine:
    """A prefix-caching inference engine over one model.

    A background thread runs the model; every method here may be called from any thread
    (``generate``, ``stream``) or event loop (``agenerate``, ``astream``) concurrently.
    Requests sharing a prefix share its KV: ``RequestOutput.cached_tokens`` says how much of a
    prompt was served from the cache.

    ``model``: None (the bundled SmolLM2-135M-Instruct), a HF Llama-family checkpoint directory
    or a .gguf file; or (advanced) an already loaded ``engine.model.loader.LoadedModel``, which is
    then shared, not copied (``device``/``dtype`` are the loaded model's). The KV cache holds
    ``num_pages`` pages of ``page_size`` tokens, or as many as fit in ``kv_cache_bytes``.
    ``prefix_cache=False`` reuses nothing across requests (the baseline for benchmarks).
    Below the pool, evicted pages can go to host memory (``kv_host_bytes``) and to page files
    in ``kv_disk_dir`` (within ``kv_disk_bytes``; default: half the free space, at most
    16 GiB); a later prompt with their prefix loads them back instead of recomputing them,
    and an engine started again on the same directory, model and dtype finds them there
    (``close()`` writes the pool's pages down first). Off by default.
    On the CPU, prefill-sized passes run on ``threads`` intra-op threads (None: torch's
    default, the machine's cores) and decode steps on one, which is faster for their many
    small ops; the engine sets torch's thread count from its loop thread for each pass.
    ``batch_invariant=True`` (the default on the CPU) makes every greedy answer independent of
    the batch it ran in, the cache (hit, miss, partial), prefill chunking, preemption, cascade
    decode and the page size, in float32 and bfloat16 alike; ``False`` runs the older kernels,
    which are exact only up to float rounding. ``dtype=None`` picks the faster of float32 and
    bfloat16 as measured on this CPU (``engine.model.probe``, cached).
    Further keyword arguments are other ``scheduler.SchedulerConfig`` fields (advanced tuning:
    ``group_min_tokens``, ``reserve_ratio_init``, ...).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel | None = None,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        max_batch_tokens: int | None = None,
        max_running: int | None = None,
        policy: str = "lpm",
        prefix_cache: bool = True,
        backend: str = "auto",
        threads: int | None = None,
        batch_invariant: bool = True,
        kv_host_bytes: int | None = None,
        kv_disk_dir: str | os.PathLike[str] | None = None,
        kv_disk_bytes: int | None = None,
        **scheduler_options: Any,
    ) -> None:
        # Every argument is checked before the (slow) model load.
        _check_model_arg(model)
        _check_engine_args(page_size, num_pages, kv_cache_bytes, prefix_cache)
        check_tier_args(kv_host_bytes, kv_disk_dir, kv_disk_bytes, prefix_cache)
        thread_policy = ThreadPolicy.default(threads)
        sched_config = _scheduler_config(
            page_size, policy, max_batch_tokens, max_running,
            {**scheduler_options, "prefix_cache": prefix_cache},
        )
        _check_backend(backend)
        loaded = model if isinstance(model, LoadedModel) else load_model(model, device, dtype)
        warn_if_slow_dtype(loaded.device, loaded.dtype)
        self._tokenizer = loaded.tokenizer
        self._config = loaded.config
        self._device = loaded.device
        self._dtype = loaded.dtype
        self._prefix_cache = prefix_cache
        pages = _pool_pages(loaded, page_size, num_pages, kv_cache_bytes)
        _check_pool_fits(loaded, page_size, pages, "num_pages" if num_pages else "kv_cache_bytes")
        cfg = loaded.config
        pool = KVPool(
            cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim,
            loaded.dtype, loaded.device,
        )
        tiers = build_tiers(loaded, pool, kv_host_bytes, kv_disk_dir, kv_disk_bytes)
        kv = KVManager(pages, page_size, prefix_cache, tiers)
        runner = ModelRunner(
            loaded,
            pool,
            backend=_resolve_backend(backend, loaded.device),
            threads=thread_policy,
            batch_invariant=batch_invariant and loaded.device.type == "cpu",
        )
        self._batch_invariant = runner.batch_invariant and _verified(loaded, batch_invariant)
        self._attention_kernel = runner.backend.kernel_name
        self._page_size = page_size
        self._num_pages = kv.num_pages
        self._eos_token_ids = frozenset(cfg.eos_token_ids)
        self._request_ids = itertools.count()
        self._loop = EngineLoop(Scheduler(kv, sched_config), runner)
        # Closes the loop (and frees the pool) if the engine is dropped without close().
        self._finalizer = weakref.finalize(self, self._loop.close)

    # ------------------------------------------------------------------------------ properties

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_config(self) -> Any:
        return self._config

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens one request may hold (the model's context)."""
        return int(self._config.max_position_embeddings)

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def prefix_cache(self) -> bool:
        """False: nothing is reused across requests (the benchmarks' baseline)."""
        return self._prefix_cache

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
    ) -> RequestHandle:
        """Queues one request and returns its handle at once: every other way in builds on it.

        ``prompt``: a str, a list of token ids, or a conversation ``[{"role", "content"}, ...]``
        (rendered with the chat template). Everything is validated here, in the caller's
        thread: a bad request raises ValueError and nothing is queued. With ``stream=True``
        iterating the handle yields text deltas before the RequestOutput. ``handle.result()``
        (or ``await handle.aresult()``) waits for the output; ``handle.abort()`` stops it.
        """
        [(ids, p)] = self._prepare(prompt, params, namespace, single=True)
        return self._submit_ids(ids, p, namespace, stream)

    def generate(
        self, prompts: Any, params: ParamsArg = None, namespace: str | None = None
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; returns their outputs in input order (always a list).

        ``prompts``: one prompt (as for ``submit``) or a list of them. ``params``: one
        SamplingParams for all, or one per prompt. If a request fails, the others still run
        to completion and then the first error is raised.
        """
        handles: list[RequestHandle] = []
        finished = 0
        try:
            for ids, p in self._prepare(prompts, params, namespace):
                handles.append(self._submit_ids(ids, p, namespace))
            events = []
            for handle in handles:
                events.append(handle.final_event())
                finished += 1
        finally:
            for handle in handles[finished:]:  # interrupted (KeyboardInterrupt) or submit failed
                handle.abort()
        return outputs_or_raise(events)

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
        try:
            events = await asyncio.gather(*(h.afinal_event() for h in handles))
        finally:
            for handle in handles:  # cancelled: abort what has not finished
                handle.abort()
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
    ) -> ChatSession:
        """A multi-turn chat session; each turn reuses the KV of the conversation so far."""
        from engine.serving.chat import ChatSession

        return ChatSession(self, system=system, params=params, namespace=namespace)

    def encode(self, prompt: Any, field: str = "prompt") -> list[int]:
        """The token ids ``submit`` would run for ``prompt`` (a conversation rendered with the
        chat template), validated the same way; ValueError names ``field``."""
        if self.closed:
            raise EngineDeadError("the engine is closed")
        return encode_one(self._tokenizer, prompt, self._config.vocab_size, field)

    # ------------------------------------------------------------------------- state, shutdown

    @property
    def alive(self) -> bool:
        """True while the engine loop runs (False once it died or the engine was closed)."""
        return not self.closed and self._loop.alive

    def subscribe_kv(self, listener: Callable[[KVEvent], None]) -> None:
        """Call ``listener`` with every ``PagesStored``/``PagesEvicted`` of this engine's KV
        pool from now on, on the engine loop's thread (keep it short). A replica's KV-event
        publisher follows the cache this way; subscribe before serving anything."""
        self._loop.subscribe_kv(listener)

    def num_waiting(self) -> int:
        """Requests submitted and not yet running (what a server's queue limit counts)."""
        return self._loop.num_waiting()

    def stats(self) -> EngineStats:
        """Monotone counters (requests, prompt/cached/computed/generated tokens, evicted pages,
        preemptions), the hit rate derived from them, and the current page accounting."""
        return self._loop.stats()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no request is queued or running (and the page accounting was checked);
        False on timeout."""
        return self._loop.wait_idle(timeout)

    def close(self) -> None:
        """Aborts what is in flight, stops the loop thread and frees the KV cache."""
        self._finalizer()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

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
        return prepare_prompts(
            self._tokenizer, self._config.vocab_size, self.max_context,
            self._num_pages * self._page_size, prompts, params, namespace, single,
        )

    def _submit_ids(
        self,
        token_ids: list[int],
        params: SamplingParams,
        namespace: str | None,
        stream: bool = False,
    ) -> RequestHandle:
        """Queues validated token ids (from ``_prepare``)."""
        request = Request(
            next(self._request_ids), token_ids, params, namespace, self._eos_token_ids
        )
        handle = RequestHandle(request.id, self._loop.abort)
        detokenizer = IncrementalDetokenizer(self._tokenizer, stop=params.stop, prompt_ids=token_ids)
        self._loop.submit(Job(request, detokenizer, handle, stream))
        return handle


def warn_if_slow_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """float16 on a CPU has no fast kernels in torch (~5x slower than float32 here): say so."""
    if device.type == "cpu" and dtype == torch.float16:
        warnings.warn(
            "dtype: float16 on the CPU runs several times slower than float32 (torch has no "
            "fast CPU kernels for it); use float32, bfloat16, or dtype=None to measure",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_model_arg(model: Any) -> None:
    if model is None or isinstance(model, LoadedModel):
        return
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(
            f"model: expected a checkpoint directory or .gguf path (str), got "
            f"{type(model).__name__}"
        )
    if not os.fspath(model):
        raise ValueError("model: empty path; pass None for the bundled model")


def _check_pool_fits(loaded: LoadedModel, page_size: int, pages: int, field: str) -> None:
    """The KV pool must fit the memory there is, checked before allocating it (a pool too
    large for the machine would get the process killed, not an error)."""
    cfg = loaded.config
    per_page = KVPool.bytes_per_page(
        cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
    )
    need = pages * per_page
    if loaded.device.type == "cuda":
        available = torch.cuda.mem_get_info(loaded.device)[0]
    else:
        available = available_memory_bytes()
    if need > available:
        raise ValueError(
            f"{field}: {pages} pages x {per_page:,} bytes (page_size {page_size}) = {need:,} "
            f"bytes of KV cache, more than the {available:,} bytes of memory available"
        )


def _check_engine_args(
    page_size: Any, num_pages: Any, kv_cache_bytes: Any, prefix_cache: Any
) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size: must be an int >= 1, got {page_size!r}")
    if num_pages is not None and kv_cache_bytes is not None:
        raise ValueError("num_pages, kv_cache_bytes: give at most one of them")
    if num_pages is not None and (
        not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1
    ):
        raise ValueError(f"num_pages: must be an int >= 1, got {num_pages!r}")
    if kv_cache_bytes is not None and (
        not isinstance(kv_cache_bytes, int) or isinstance(kv_cache_bytes, bool)
        or kv_cache_bytes < 1
    ):
        raise ValueError(f"kv_cache_bytes: must be an int >= 1, got {kv_cache_bytes!r}")
    if not isinstance(prefix_cache, bool):
        raise ValueError(f"prefix_cache: must be a bool, got {prefix_cache!r}")


def _scheduler_config(
    page_size: int,
    policy: str,
    max_batch_tokens: int | None,
    max_running: int | None,
    options: dict[str, Any],
) -> SchedulerConfig:
    args: dict[str, Any] = {"page_size": page_size, "policy": policy, **options}
    if max_batch_tokens is not None:
        args["max_batch_tokens"] = max_batch_tokens
    if max_running is not None:
        args["max_running"] = max_running
    known = set(SchedulerConfig.__struct_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"{unknown[0]}: not an Engine or SchedulerConfig option; "
            f"scheduler options: {', '.join(sorted(known))}"
        )
    return SchedulerConfig(**args)


def _pool_pages(
    loaded: LoadedModel, page_size: int, num_pages: int | None, kv_cache_bytes: int | None
) -> int:
    if num_pages is not None:
        return num_pages
    cfg = loaded.config
    if kv_cache_bytes is None:
        if loaded.device.type == "cuda":
            kv_cache_bytes = KVPool.cuda_budget_bytes(CUDA_KV_FRACTION, loaded.device)
        else:
            kv_cache_bytes = min(CPU_KV_BYTES, machine_memory_bytes() // 8)
    pages = KVPool.pages_for_bytes(
        kv_cache_bytes, cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
    )
    if pages < 1:
        per_page = KVPool.bytes_per_page(
            cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
        )
        raise ValueError(
            f"kv_cache_bytes: {kv_cache_bytes} is less than one page ({per_page} bytes)"
        )
    return pages


def _verified(loaded: LoadedModel, batch_invariant: bool) -> bool:
    """Whether the dtype probe verified this machine's forward in the model's dtype as
    batch-invariant (``engine.model.probe``); warns when it was asked for and not verified."""
    if not batch_invariant or loaded.device.type != "cpu":
        return False
    from engine.model.probe import probe

    name = str(loaded.dtype).removeprefix("torch.")
    report = probe().reports.get(name)
    if report is not None and report.usable:
        return True
    why = "its probe crashed" if report is None else (
        f"not invariant ({', '.join(report.failed)})" if not report.invariant
        else f"{report.error:.2g} from float32"
    )
    warnings.warn(
        f"batch_invariant: the {name} forward was not verified on this CPU ({why}); "
        "greedy answers may depend on the batch and the cache",
        stacklevel=3,
    )
    return False


def _check_backend(backend: str) -> None:
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; available: auto, {', '.join(BACKENDS)}")


def _resolve_backend(backend: str, device: torch.device) -> str:
    """"auto": FlashInfer on CUDA where it is installed (the ``gpu`` extra), the torch one
    otherwise (on the CPU the flashinfer backend is only its slow reference, for tests)."""
    if backend != "auto":
        return backend
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"
