"""radixkv's engine: the model, the engine loop and the public API.

    from engine import Engine, SamplingParams
    with Engine() as engine:
        [out] = engine.generate("Hello", SamplingParams(max_new_tokens=32, temperature=0.0))

The public names load on first access, so importing a submodule (``engine.model.loader``,
``engine.model.runner``) does not pull in the scheduler and the engine loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.serving.chat import ChatSession
    from engine.serving.engine import Engine
    from engine.serving.errors import EngineDeadError
    from engine.serving.handle import RequestHandle
    from engine.serving.outputs import RequestOutput
    from engine.serving.stats import EngineStats
    from scheduler import SamplingParams

__all__ = [
    "ChatSession",
    "Engine",
    "EngineDeadError",
    "EngineStats",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
]

_HOMES = {
    "ChatSession": "engine.serving.chat",
    "Engine": "engine.serving.engine",
    "EngineDeadError": "engine.serving.errors",
    "EngineStats": "engine.serving.stats",
    "RequestHandle": "engine.serving.handle",
    "RequestOutput": "engine.serving.outputs",
    "SamplingParams": "scheduler.params",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
