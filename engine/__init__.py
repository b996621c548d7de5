"""radixkv's engine: the model, the engine loop and the public API.

    from engine import Engine, SamplingParams
    with Engine() as engine:
        [out] = engine.generate("Hello", SamplingParams(max_new_tokens=32, temperature=0.0))

This package's names are the only way ``server``, ``cluster`` and ``workloads`` reach the
engine (``tests/test_layering.py`` holds them to it). They load on first access, so importing a
submodule (``engine.model.loader``, ``engine.model.runner``) does not pull in the scheduler
and the engine loop, and ``from engine import load_front`` does not load torch's model code
beyond what the front needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.client import EngineClient, PromptIds
    from engine.config import EngineConfig
    from engine.model.cpu.machine import cache_root
    from engine.model.kv_pool import KVPool
    from engine.model.loader import (
        LoadedModel,
        ModelFront,
        bundled_gguf_path,
        checkpoint_dir,
        load_front,
        load_hf_reference,
        load_model,
    )
    from engine.model.sampler import TokenLogprob
    from engine.serving.chat import ChatSession, continue_tokens
    from engine.serving.cli import build_parser, engine_options, run_command
    from engine.serving.engine import Engine
    from engine.serving.errors import ContextLengthError, EngineDeadError
    from engine.serving.handle import Delta, Done, Failed, RequestHandle, abort_on_exit
    from engine.serving.outputs import RequestOutput
    from engine.serving.prompts import PromptPreparer, kept_prompt
    from engine.serving.stats import EngineStats
    from engine.serving.tools import (
        CallScanner,
        ToolCall,
        calls_text,
        check_json_schema,
        check_tools,
        cut_tool_calls,
        is_call_reply,
        new_call_id,
        parse_tool_calls,
        scan_calls,
        tool_constraint,
        with_tools,
    )
    from scheduler import SamplingParams, StructuredOutputsParams

_HOMES = {
    # the API
    "Engine": "engine.serving.engine",
    "EngineConfig": "engine.config",
    "EngineClient": "engine.client",
    "PromptIds": "engine.client",
    "SamplingParams": "scheduler.params",
    "StructuredOutputsParams": "scheduler.params",
    "RequestOutput": "engine.serving.outputs",
    "TokenLogprob": "engine.model.sampler",
    "RequestHandle": "engine.serving.handle",
    "Delta": "engine.serving.handle",
    "Done": "engine.serving.handle",
    "Failed": "engine.serving.handle",
    "abort_on_exit": "engine.serving.handle",
    "EngineDeadError": "engine.serving.errors",
    "ContextLengthError": "engine.serving.errors",
    "EngineStats": "engine.serving.stats",
    "PromptPreparer": "engine.serving.prompts",
    "kept_prompt": "engine.serving.prompts",
    "ChatSession": "engine.serving.chat",
    "ToolCall": "engine.serving.tools",
    "calls_text": "engine.serving.tools",
    "CallScanner": "engine.serving.tools",
    "is_call_reply": "engine.serving.tools",
    "new_call_id": "engine.serving.tools",
    "scan_calls": "engine.serving.tools",
    "check_tools": "engine.serving.tools",
    "check_json_schema": "engine.serving.tools",
    "parse_tool_calls": "engine.serving.tools",
    "cut_tool_calls": "engine.serving.tools",
    "tool_constraint": "engine.serving.tools",
    "with_tools": "engine.serving.tools",
    "continue_tokens": "engine.serving.chat",
    # the commands (radixkv chat / generate; serve builds on them)
    "build_parser": "engine.serving.cli",
    "engine_options": "engine.serving.cli",
    "run_command": "engine.serving.cli",
    # models and the machine, for front ends and benchmarks
    "LoadedModel": "engine.model.loader",
    "ModelFront": "engine.model.loader",
    "load_model": "engine.model.loader",
    "load_front": "engine.model.loader",
    "load_hf_reference": "engine.model.loader",
    "bundled_gguf_path": "engine.model.loader",
    "checkpoint_dir": "engine.model.loader",
    "KVPool": "engine.model.kv_pool",
    "cache_root": "engine.model.cpu.machine",
}

__all__ = [
    "CallScanner",
    "kept_prompt",
    "is_call_reply",
    "new_call_id",
    "scan_calls",
    "ToolCall",
    "calls_text",
    "check_tools",
    "check_json_schema",
    "parse_tool_calls",
    "cut_tool_calls",
    "tool_constraint",
    "with_tools",
    "StructuredOutputsParams",
    "abort_on_exit",
    "PromptPreparer",
    "build_parser",
    "engine_options",
    "run_command",
    "ContextLengthError",
    "ChatSession",
    "Delta",
    "Done",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "Failed",
    "KVPool",
    "LoadedModel",
    "ModelFront",
    "PromptIds",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "bundled_gguf_path",
    "cache_root",
    "checkpoint_dir",
    "continue_tokens",
    "load_front",
    "load_hf_reference",
    "load_model",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
