"""radixkv's engine: the model, the engine loop and the public API.

    from engine import Engine, SamplingParams
    with Engine() as engine:
        [out] = engine.generate("Hello", SamplingParams(max_new_tokens=32, temperature=0.0))

The public names load on first access, so importing a submodule (``engine.loader``,
``engine.runner``) does not pull in the scheduler and the engine loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.chat import ChatSession
    from engine.engine import Engine
    from engine.errors import EngineDeadError
    from engine.outputs import RequestOutput
    from engine.sampling import SamplingParams
    from engine.stats import EngineStats

__all__ = [
    "ChatSession",
    "Engine",
    "EngineDeadError",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
]

_HOMES = {
    "ChatSession": "engine.chat",
    "Engine": "engine.engine",
    "EngineDeadError": "engine.errors",
    "EngineStats": "engine.stats",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
