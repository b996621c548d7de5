"""The words of the engine seam: what a front end (the HTTP server, a replica's router, a
benchmark) sends an engine and gets back, and nothing that runs a model.

A leaf: it imports no engine module outside ``engine.api`` (only the scheduler's and the KV
manager's records that ``EngineStats`` carries), so ``server`` and ``cluster`` can speak to an
``EngineClient`` without loading the engine, and the engine's insides can move without them.
"""

from __future__ import annotations

from engine.api.client import EngineClient, PromptIds, context_limit
from engine.api.errors import ContextLengthError, EngineDeadError
from engine.api.handle import (
    Delta,
    Done,
    Event,
    Failed,
    HandleSink,
    RequestHandle,
    TextStream,
    abort_on_exit,
)
from engine.api.inspector import InspectSnapshot
from engine.api.outputs import RequestOutput, TokenLogprob, ToolCall
from engine.api.pins import MAX_PIN_TTL_S, PrefixPin, check_pin_ttl
from engine.api.stats import EngineStats

__all__ = [
    "MAX_PIN_TTL_S",
    "ContextLengthError",
    "Delta",
    "Done",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "Event",
    "Failed",
    "HandleSink",
    "InspectSnapshot",
    "PrefixPin",
    "PromptIds",
    "RequestHandle",
    "RequestOutput",
    "TextStream",
    "TokenLogprob",
    "ToolCall",
    "abort_on_exit",
    "check_pin_ttl",
    "context_limit",
]
