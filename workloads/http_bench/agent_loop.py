"""An agent loop written against the official ``openai`` client, as an application would run
it against ``radixkv serve``: tool definitions, then steps that each send the whole trajectory
back (the tools, every call and every result) and get the next call. It prints, per step, the
prompt, the part of it served from the cache, and the time; a prefix cache should serve
everything before each step's new tool result.

    radixkv serve &            # or any OpenAI-compatible server
    python -m workloads.http_bench.agent_loop --base-url http://127.0.0.1:8000/v1 [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import msgspec

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "search_notes", "description": "Search the user's notes for a phrase.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 60}}, "required": ["query"]}}},
]
TASK = (
    "Plan a picnic: check the weather in Paris, add up the cost of bread (3) and cheese (7), "
    "and look up my notes about picnic spots."
)


class Step(msgspec.Struct):
    step: int
    calls: list[str]
    prompt_tokens: int
    cached_tokens: int
    seconds: float


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    """Stand-ins for real tools: deterministic results, so runs repeat."""
    if name == "get_weather":
        return json.dumps({"city": arguments.get("city"), "temperature": 21, "sky": "clear"})
    if name == "add":
        return json.dumps({"sum": float(arguments.get("a", 0)) + float(arguments.get("b", 0))})
    return json.dumps({"notes": ["The park by the river has shade and benches."]})


def run_agent(client: Any, model: str, steps: int = 5, cache_salt: str | None = None) -> list[Step]:
    """``steps`` tool-calling steps (tool_choice "required", one call a step), each result
    fed back."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a planning assistant that uses tools."},
        {"role": "user", "content": TASK},
    ]
    extra = {"cache_salt": cache_salt} if cache_salt else {}
    record = []
    for k in range(steps):
        started = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=96, temperature=0, extra_body=extra,
        )
        seconds = time.perf_counter() - started
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append({"role": "assistant", "content": None,
                         "tool_calls": [c.model_dump() for c in calls]})
        for call in calls:
            result = run_tool(call.function.name, json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        details = reply.usage.prompt_tokens_details
        record.append(Step(
            k, [f"{c.function.name}({c.function.arguments})" for c in calls],
            reply.usage.prompt_tokens, details.cached_tokens if details else 0, seconds,
        ))
    return record


def main(argv: list[str] | None = None) -> None:
    import openai

    parser = argparse.ArgumentParser(prog="python -m workloads.http_bench.agent_loop")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    print("| step | calls | prompt tokens | cached | seconds |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for s in run_agent(client, model, args.steps):
        print(f"| {s.step} | {'; '.join(s.calls)} | {s.prompt_tokens} | {s.cached_tokens} | "
              f"{s.seconds:.2f} |")


if __name__ == "__main__":
    main()
