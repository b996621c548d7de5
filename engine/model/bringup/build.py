"""The model side of an engine, built from its ``EngineConfig``: the platform for its device,
the KV pool sized for this machine and the runner with the attention backend it resolves to.

What is decided here depends on the loaded model and the machine (free memory, the dtype
probe's verdict), so it runs after the load; the config's own checks ran before it.
"""

from __future__ import annotations

import warnings

import torch

from engine.config import EngineConfig
from engine.model.bringup.device_check import verify_on_device
from engine.model.bringup.dtype_probe import probe
from engine.model.bringup.platforms import platform_for, resolve_backend
from engine.model.cpu.threads import ThreadPolicy
from engine.model.kv_pool import KVPool
from engine.model.loader import LoadedModel
from engine.model.platform import Platform
from engine.model.runner import ModelRunner
from engine.model.structured import Grammars


def build_platform(loaded: LoadedModel, config: EngineConfig) -> Platform:
    """The platform of ``loaded``'s device for the backend ``config.backend`` resolves to,
    passes on ``config.threads`` threads."""
    backend = resolve_backend(config.backend, loaded.device)
    return platform_for(loaded.device, backend, ThreadPolicy.default(config.threads))


def build_pool(loaded: LoadedModel, config: EngineConfig, platform: Platform) -> KVPool:
    """The KV pool: ``num_pages`` pages, or as many as ``kv_cache_bytes`` (or the platform's
    default budget) holds; refused before allocating when the device has not the memory."""
    cfg = loaded.config
    page_size = config.page_size
    per_page = KVPool.bytes_per_page(
        cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
    )
    memory = platform.kv_memory()
    pages = config.num_pages
    if pages is None:
        budget = config.kv_cache_bytes
        if budget is None:
            budget = memory.default_bytes
        pages = KVPool.pages_for_bytes(
            budget, cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
        )
        if pages < 1:
            raise ValueError(f"kv_cache_bytes: {budget} is less than one page ({per_page} bytes)")
    # A pool too large for the machine would get the process killed, not an error.
    need = pages * per_page
    available = memory.available_bytes
    if need > available:
        field = "num_pages" if config.num_pages else "kv_cache_bytes"
        raise ValueError(
            f"{field}: {pages} pages x {per_page:,} bytes (page_size {page_size}) = {need:,} "
            f"bytes of KV cache, more than the {available:,} bytes of memory available"
        )
    return KVPool(
        cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim,
        loaded.dtype, loaded.device, scratch_pages=1 if uses_graphs(config, platform) else 0,
    )


def uses_graphs(config: EngineConfig, platform: Platform) -> bool:
    """Decode graphs: asked for, where the platform captures them (CUDA), with FlashInfer (the
    only backend with graph-mode wrappers)."""
    return (
        config.cuda_graphs
        and platform.captures_graphs
        and resolve_backend(config.backend, platform.device) == "flashinfer"
    )


def build_runner(
    loaded: LoadedModel,
    pool: KVPool,
    config: EngineConfig,
    platform: Platform,
    grammars: Grammars | None = None,
) -> ModelRunner:
    """The runner over ``pool`` on ``platform`` with the backend ``config.backend`` resolves
    to, masking by ``grammars`` (structured outputs)."""
    return ModelRunner(
        loaded,
        pool,
        platform,
        backend=resolve_backend(config.backend, loaded.device),
        batch_invariant=config.batch_invariant,
        grammars=grammars,
        cuda_graphs=uses_graphs(config, platform),
        max_batch=config.scheduler.max_running,
        max_verify_rows=verify_rows(config),
    )


def verify_rows(config: EngineConfig) -> int:
    """Rows of the largest verify pass the scheduler can make (0 without speculation): every
    running request with a full draft."""
    scheduler = config.scheduler
    if scheduler.speculation == "off":
        return 0
    return scheduler.max_running * (1 + scheduler.num_speculative_tokens)


def verified_invariant(loaded: LoadedModel, asked: bool, runner: ModelRunner) -> bool:
    """Whether this machine's forward is verified batch-invariant: by checking ``runner``
    itself now where its platform's promise depends on the device (``device_check``: CUDA,
    FlashInfer's reference), else by the dtype probe's verdict (``dtype_probe``: the CPU);
    warns when it was asked for and not verified."""
    if not asked:
        return False
    if runner.platform.verifies_runner:
        return verify_on_device(runner)
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
        stacklevel=5,
    )
    return False


def warn_if_slow_dtype(platform: Platform, dtype: torch.dtype) -> None:
    """Say so where ``dtype`` runs slowly on ``platform`` (float16 on a CPU: torch has no fast
    kernels for it)."""
    message = platform.dtype_warning(dtype)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=5)
