"""The engine's composition root: from an ``EngineConfig`` to the running parts.

The model is loaded, the KV pool sized for this machine, the tiers below it opened, the KV
manager, the runner and the scheduler made and the loop thread started, in that order; what
the parts learn about this machine on the way (whether the forward was verified
batch-invariant, which attention kernel and graphs run) decides what the scheduler may do.
``Engine`` holds the result and answers callers; it builds nothing itself.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from engine.config import EngineConfig
from engine.model.bringup.build import (
    build_platform,
    build_pool,
    build_runner,
    verified_invariant,
    warn_if_slow_dtype,
    widest_window,
)
from engine.model.bringup.load import load_model
from engine.model.loader import LoadedModel
from engine.model.platform import Platform
from engine.model.structured import Grammars
from engine.serving.inputs import PromptPreparer
from engine.serving.kv_tiers import build_tiers
from engine.serving.loop import EngineLoop
from radix import KVManager
from radix.window import WindowSlots
from scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("radixkv.engine")


@dataclass(frozen=True, eq=False)
class EngineParts:
    """What an ``Engine`` is made of and what it learnt about this machine while it was."""

    config: EngineConfig  # as asked for
    scheduler_config: SchedulerConfig  # as in effect (speculation and shared rows may be off)
    tokenizer: Any
    model_config: Any
    device: torch.device
    dtype: torch.dtype
    platform: Platform  # what the device provides (its memory released at close)
    inputs: PromptPreparer  # the one validation boundary
    loop: EngineLoop
    num_pages: int
    batch_invariant: bool  # verified on this machine
    attention_kernel: str
    cuda_graphs: bool
    eos_token_ids: frozenset[int]


def assemble(config: EngineConfig | None, overrides: dict[str, Any]) -> EngineParts:
    """Builds an engine from ``config`` with ``overrides`` by plain knob name; ``model`` may
    be an already loaded ``LoadedModel`` (shared, not copied: ``device``/``dtype`` are its).
    Every knob is checked before the (slow) model load."""
    model = overrides.get("model")
    loaded_model = model if isinstance(model, LoadedModel) else None
    if loaded_model is not None:
        overrides = {**overrides, "model": None}
    config = (config or EngineConfig()).replace(**overrides)
    loaded = loaded_model or load_model(config.model, config.device, config.dtype)
    platform = build_platform(loaded, config)
    warn_if_slow_dtype(platform, loaded.dtype)
    grammars = Grammars(loaded.tokenizer)  # structured outputs: checked here, masked there
    pool = build_pool(loaded, config, platform)
    window = None
    if pool.window_layers:
        window = WindowSlots(
            pool.num_pages, pool.window_pages, widest_window(loaded), config.page_size
        )
        pool.attach_window(window.slot_of)
    kv = KVManager(
        pool.num_pages, config.page_size, config.prefix_cache,
        build_tiers(loaded, pool, config, platform), config.max_pinned_fraction, window,
    )
    runner = build_runner(loaded, pool, config, platform, grammars)
    invariant = runner.batch_invariant and verified_invariant(
        loaded, config.batch_invariant, runner
    )
    log.info(
        "engine on %s (%s): attention %s, cuda graphs %s, batch_invariant=%s",
        loaded.device, str(loaded.dtype).removeprefix("torch."), runner.backend.kernel_name,
        "on" if runner.graphs is not None else "off", invariant,
    )
    scheduler_config = scheduler_config_for(config, invariant)
    inputs = PromptPreparer(
        loaded.tokenizer, loaded.config.vocab_size, int(loaded.config.max_position_embeddings),
        grammars, priority_scheduling=scheduler_config.scheduling_policy == "priority",
    )
    return EngineParts(
        config=config,
        scheduler_config=scheduler_config,
        tokenizer=loaded.tokenizer,
        model_config=loaded.config,
        device=loaded.device,
        dtype=loaded.dtype,
        platform=platform,
        inputs=inputs,
        loop=EngineLoop(Scheduler(kv, scheduler_config), kv, runner),
        num_pages=kv.num_pages,
        batch_invariant=invariant,
        attention_kernel=runner.backend.kernel_name,
        cuda_graphs=runner.graphs is not None,
        eos_token_ids=frozenset(loaded.config.eos_token_ids),
    )


def scheduler_config_for(config: EngineConfig, batch_invariant: bool) -> SchedulerConfig:
    """The scheduler's knobs, speculation and shared rows off where the passes are not
    batch-invariant: a verify pass or a follower's copied rows then need not give the numbers
    plain decoding gives, and a greedy answer must never depend on either."""
    scheduler = config.scheduler
    if batch_invariant:
        return scheduler
    if scheduler.speculation != "off":
        warnings.warn(
            f"speculation={scheduler.speculation!r} needs batch-invariant passes, which "
            "this engine does not have (batch_invariant=False, or not verified on this "
            "machine): it is off",
            stacklevel=4,
        )
    return msgspec.structs.replace(scheduler, speculation="off", share_rows=False)
