"""The OpenAI Agents SDK, unchanged but for its client's base URL, runs an agent with a
function tool against a real ``radixkv serve`` over ``/v1/responses``: the SDK's own loop
calls the model, runs the tool, and chains the turns by ``previous_response_id`` (the
conversation stored on the server), each turn finding the earlier ones in the cache."""

from __future__ import annotations

import asyncio

import pytest
from server_process import ServerProcess

agents = pytest.importorskip("agents")
from openai import AsyncOpenAI  # noqa: E402


def test_an_agents_sdk_loop_with_a_tool_runs_on_stored_responses(server: ServerProcess) -> None:
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        cities.append(city)
        return f"Sunny and 24 C in {city}."

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model="SmolLM2-135M-Instruct", openai_client=client)
    settings = agents.ModelSettings(temperature=0.0, tool_choice="required", max_tokens=60)
    forecaster = agents.Agent(
        name="forecaster", instructions="Answer weather questions with the tool.",
        tools=[get_weather], model=model, model_settings=settings,
        tool_use_behavior="stop_on_first_tool",  # a 135M model would call it again and again
    )
    # The next turn: the tool's result and a new question, on the stored conversation; the
    # same instructions and tools (so the same rendered prefix), tools not to be called.
    answerer = forecaster.clone(
        model_settings=settings.resolve(agents.ModelSettings(tool_choice="none")),
        tool_use_behavior="run_llm_again",
    )

    async def run() -> tuple[agents.RunResult, agents.RunResult]:
        first = await agents.Runner.run(
            forecaster, "What is the weather in Paris?", auto_previous_response_id=True
        )
        results = [item.to_input_item() for item in first.new_items
                   if item.type == "tool_call_output_item"]
        second = await agents.Runner.run(
            answerer, [*results, {"role": "user", "content": "Should I take an umbrella?"}],
            previous_response_id=first.last_response_id,
        )
        return first, second

    first, second = asyncio.run(run())
    assert cities == ["Paris"]
    assert first.final_output == "Sunny and 24 C in Paris."
    assert isinstance(second.final_output, str) and second.final_output
    [follow] = second.raw_responses
    # the follow-up continued the stored conversation and found it in the cache
    assert follow.usage.input_tokens_details.cached_tokens >= 64, follow.usage
