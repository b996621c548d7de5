"""OpenAI's ``tools`` and ``tool_choice`` checked once, whatever format the model writes
calls in: the functions offered, each parameters schema compiled alone, and the choice
resolved to a mode and the functions it allows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from engine.model.structured import with_json_layout

CHOICES = ("none", "auto", "required")


class ToolChoice(NamedTuple):
    """``tool_choice`` resolved: ``mode`` is "none", "auto", "required" or "named" (one
    function forced), ``functions`` the tools it offers (``allowed_tools`` narrows them)."""

    mode: str
    functions: list[dict[str, Any]]


def check_tools(tools: Any, field: str = "tools") -> list[dict[str, Any]]:
    """OpenAI's ``tools`` as a list of functions ``{"name", "description", "parameters"}``."""
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise ValueError(f"{field}: expected a non-empty list of tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{where}.function: expected an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name: expected a non-empty string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise ValueError(f"{where}.function.parameters: expected a JSON schema object")
        check_json_schema(dict(parameters), f"{where}.function.parameters")
        # OpenAI's order (a template that writes the tools as JSON shows them this way)
        entry: dict[str, Any] = {"name": name}
        if function.get("description"):
            entry["description"] = str(function["description"])
        entry["parameters"] = dict(parameters)
        functions.append(entry)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: function names must be unique, got {names}")
    return functions


def check_json_schema(schema: dict[str, Any], field: str) -> None:
    """A ValueError naming ``field`` when ``schema`` cannot compile (an unknown type, a bad
    ``$ref``). Each schema the client sent is checked alone, before it is combined with
    others (the tools' call, a reply format): the combined grammar's error could only name
    the whole, under a field the client never sent. No tokenizer is needed for this, so a
    front end without the engine can check too."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(with_json_layout(schema))
        error = LLMatcher.validate_grammar(grammar, None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{field}: {exc}") from None
    if error and not error.startswith("WARNING"):
        raise ValueError(f"{field}: cannot compile: {error.strip().splitlines()[0]}")


def resolve_choice(
    functions: list[dict[str, Any]], choice: Any, field: str = "tool_choice"
) -> ToolChoice:
    """``tool_choice`` (None: "auto") as a mode and the functions it offers."""
    if choice is None:
        return ToolChoice("auto", functions)
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(
                f"{field}: expected one of {CHOICES} or a named function, got {choice!r}"
            )
        return ToolChoice(choice, functions)
    if not isinstance(choice, Mapping):
        raise ValueError(f"{field}: expected one of {CHOICES} or an object, got {choice!r}")
    kind = choice.get("type", "function")
    if kind == "function":
        return ToolChoice("named", _named(functions, choice.get("function"), f"{field}.function"))
    if kind == "allowed_tools":
        allowed = choice.get("allowed_tools")
        where = f"{field}.allowed_tools"
        if not isinstance(allowed, Mapping):
            raise ValueError(f"{where}: expected an object with a mode and tools")
        mode = allowed.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise ValueError(f"{where}.mode: expected 'auto' or 'required', got {mode!r}")
        tools = allowed.get("tools")
        if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
            raise ValueError(f"{where}.tools: expected a non-empty list of tools")
        chosen = []
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            chosen += _named(functions, function, f"{where}.tools[{i}].function")
        return ToolChoice(mode, chosen)
    raise ValueError(f"{field}.type: expected 'function' or 'allowed_tools', got {kind!r}")


def _named(functions: list[dict[str, Any]], function: Any, where: str) -> list[dict[str, Any]]:
    """The one tool ``{"name": ...}`` names."""
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.name: expected the name of one of the tools")
    chosen = [f for f in functions if f["name"] == function["name"]]
    if not chosen:
        raise ValueError(
            f"{where}.name: {function['name']!r} is not one of the tools "
            f"{[f['name'] for f in functions]}"
        )
    return chosen
