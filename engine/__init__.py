"""radixkv's engine: the model, the engine loop and the public API.

    from engine import Engine, SamplingParams
    with Engine() as engine:
        [out] = engine.generate("Hello", SamplingParams(max_new_tokens=32, temperature=0.0))

``server``, ``cluster`` and ``workloads`` reach the engine through this package's names and
``engine.api`` (the seam's types: outputs, the handle and its events, stats, errors,
``EngineClient``), nothing else (``tests/test_layering.py`` holds them to it). The names here
are the engine itself, its commands, the front that encodes prompts without a model, models
and the machine for benchmarks, and ``tools`` (the tool-call format, as one namespace). They
load on first access, so importing a submodule (``engine.model.loader``) does not pull in the
scheduler and the engine loop, and ``from engine import load_front`` does not load torch's
model code beyond what the front needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for type checkers (``X as X``: re-exported)
    from engine.config import EngineConfig as EngineConfig
    from engine.model.bringup.load import load_model as load_model
    from engine.model.cache_root import cache_root as cache_root
    from engine.model.kv_pool import KVPool as KVPool
    from engine.model.loader import ModelFront as ModelFront
    from engine.model.loader import bundled_gguf_path as bundled_gguf_path
    from engine.model.loader import checkpoint_dir as checkpoint_dir
    from engine.model.loader import load_front as load_front
    from engine.model.loader import load_hf_reference as load_hf_reference
    from engine.serving import tools as tools
    from engine.serving.chat import ChatSession as ChatSession
    from engine.serving.cli import build_parser as build_parser
    from engine.serving.cli import engine_options as engine_options
    from engine.serving.cli import run_command as run_command
    from engine.serving.conversation import continue_tokens as continue_tokens
    from engine.serving.engine import Engine as Engine
    from engine.serving.inputs import PromptPreparer as PromptPreparer
    from scheduler import SamplingParams as SamplingParams
    from scheduler import StructuredOutputsParams as StructuredOutputsParams

# module -> the names it gives this package (the one list: ``__all__`` is read from it)
_HOMES_BY_MODULE = {
    # the engine and what a request asks for
    "engine.serving.engine": ("Engine",),
    "engine.config": ("EngineConfig",),
    "scheduler.params": ("SamplingParams", "StructuredOutputsParams"),
    "engine.serving.chat": ("ChatSession",),
    "engine.serving.conversation": ("continue_tokens",),
    # the commands (radixkv chat / generate; serve builds on them)
    "engine.serving.cli": ("build_parser", "engine_options", "run_command"),
    # a front without the model: prompts encoded and checked
    "engine.serving.inputs": ("PromptPreparer",),
    # models and the machine, for front ends and benchmarks
    "engine.model.loader": (
        "ModelFront", "load_front", "load_hf_reference", "bundled_gguf_path", "checkpoint_dir",
    ),
    "engine.model.bringup.load": ("load_model",),
    "engine.model.kv_pool": ("KVPool",),
    "engine.model.cache_root": ("cache_root",),
}
_HOMES = {name: module for module, names in _HOMES_BY_MODULE.items() for name in names}
# Namespaces: a module under a name of its own.
_MODULES = {"tools": "engine.serving.tools"}

__all__ = sorted([*_HOMES, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
