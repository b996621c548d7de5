"""The model side of an engine, built from its ``EngineConfig``: the platform for its device,
the KV pool sized for this machine and the runner with the attention backend it resolves to.

What is decided here depends on the loaded model and the machine (free memory, the dtype
probe's verdict), so it runs after the load; the config's own checks ran before it.
"""

from __future__ import annotations

import math
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
from radix.window import CHECKPOINT_WINDOWS, WindowSlots


def build_platform(loaded: LoadedModel, config: EngineConfig) -> Platform:
    """The platform of ``loaded``'s device for the backend ``config.backend`` resolves to,
    passes on ``config.threads`` threads."""
    backend = resolve_backend(config.backend, loaded.device)
    return platform_for(loaded.device, backend, ThreadPolicy.default(config.threads))


def build_pool(loaded: LoadedModel, config: EngineConfig, platform: Platform) -> KVPool:
    """The KV pool: ``num_pages`` pages, or as many as ``kv_cache_bytes`` (or the platform's
    default budget) holds; refused before allocating when the device has not the memory.

    A model with sliding-window layers gets a window-aware pool (``window_layers``) where it
    can: the budget is split so that every pool page (its full-attention layers) comes with
    ``window_kv_fraction`` of a window slot (its window layers)."""
    cfg = loaded.config
    page_size = config.page_size
    layer_page = KVPool.bytes_per_page(1, page_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    window_layers = window_layers_for(loaded, config, platform)
    fraction = config.window_kv_fraction if window_layers else 0.0
    full_layers = cfg.num_layers - len(window_layers)
    memory = platform.kv_memory()
    pages = config.num_pages
    slots = 0
    if pages is None:
        budget = config.kv_cache_bytes
        if budget is None:
            budget = memory.default_bytes
        pages, slots = split_budget(
            budget, layer_page, full_layers, len(window_layers), fraction,
            widest_window(loaded), page_size,
        )
        if pages < 1:
            per_page = layer_page * cfg.num_layers
            raise ValueError(f"kv_cache_bytes: {budget} is less than one page ({per_page} bytes)")
    elif window_layers:
        slots = window_slots_for(pages, fraction, widest_window(loaded), page_size)
    if not slots:  # a pool this small, or a window this wide: every page keeps every layer
        window_layers = ()
    # A pool too large for the machine would get the process killed, not an error.
    per_page = layer_page * (cfg.num_layers - len(window_layers))
    per_slot = layer_page * len(window_layers)
    need = pages * per_page + slots * per_slot
    available = memory.available_bytes
    if need > available:
        field = "num_pages" if config.num_pages else "kv_cache_bytes"
        window = f" + {slots} window slots x {per_slot:,} bytes" if slots else ""
        raise ValueError(
            f"{field}: {pages} pages x {per_page:,} bytes (page_size {page_size}){window} = "
            f"{need:,} bytes of KV cache, more than the {available:,} bytes of memory available"
        )
    return KVPool(
        cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim,
        loaded.dtype, loaded.device, scratch_pages=1 if uses_graphs(config, platform) else 0,
        window_layers=window_layers, window_pages=slots,
    )


SLOT_FLOOR_WINDOWS = 3  # a budget's window slots hold at least this many windows


def split_budget(
    budget: int, layer_page: int, full_layers: int, window_layers: int, fraction: float,
    window: int, page_size: int,
) -> tuple[int, int]:
    """(pool pages, window slots) in ``budget`` bytes: each page costs ``full_layers``
    layers' KV (``layer_page``: one layer's K and V of one page), each slot
    ``window_layers`` layers'; ``fraction`` slots a page, but at least SLOT_FLOOR_WINDOWS
    windows' worth (a running request's window, a cached one's and room). (pages, 0), every
    page keeping every layer, where that split would hold no more pages."""
    whole = int(budget // (layer_page * (full_layers + window_layers)))
    if not window_layers or not fraction:
        return whole, 0
    floor = SLOT_FLOOR_WINDOWS * -(-window // page_size) + 2
    pages = int(budget // (layer_page * (full_layers + fraction * window_layers)))
    slots = math.ceil(pages * fraction)
    if slots < floor:
        slots = floor
        rest = budget - slots * window_layers * layer_page
        pages = int(rest // (layer_page * full_layers)) if full_layers else int(slots / fraction)
    if pages <= whole or slots >= pages:
        return whole, 0
    return pages, slots


def window_slots_for(pages: int, fraction: float, window: int, page_size: int) -> int:
    """Window slots of a pool of ``pages``: ``fraction`` of them, at least what one request's
    window needs; 0 where even that is more than the pool (every page keeps every layer)."""
    least = WindowSlots.least_slots(window, page_size)
    slots = min(pages, max(least, math.ceil(pages * fraction)))
    return slots if slots >= least else 0


def window_layers_for(
    loaded: LoadedModel, config: EngineConfig, platform: Platform
) -> tuple[int, ...]:
    """The layers whose KV a window-aware pool keeps only near each sequence's end: the
    model's sliding-window layers, unless ``window_kv_fraction`` is 0, KV tiers are on (their
    pages are whole) or decode graphs run (FlashInfer: no windows)."""
    cfg = loaded.config
    if not config.window_kv_fraction or config.tiered or uses_graphs(config, platform):
        return ()
    if not window_pays(widest_window(loaded), int(cfg.max_position_embeddings)):
        return ()
    return tuple(layer for layer in range(cfg.num_layers) if cfg.is_window_layer(layer))


def window_pays(window: int, context: int) -> bool:
    """Whether keeping window layers' KV only near sequence ends can pay for a model: its
    context holds several windows (a window as long as most sequences frees nothing and only
    cuts hits back: Gemma 2's 4,096 of 8,192)."""
    return window > 0 and context >= CHECKPOINT_WINDOWS * window


def widest_window(loaded: LoadedModel) -> int:
    """The largest sliding window of the model's layers (0: none)."""
    return max(loaded.config.layer_windows, default=0)


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
