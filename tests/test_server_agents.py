"""The OpenAI Agents SDK (``openai-agents``) runs an agent with one function tool against a live
``ruvllm serve`` on SmolLM2, through the SDK's Responses model and through its chat-completions model:
the tool is called with arguments the SDK parsed from the model's call, its output goes back to the
model, and the run ends with the model's answer.

Greedy (temperature 0), the first turn must call the tool (``tool_choice: required``) and the next
may not (``none``, set by the agent's hook once the tool ran: under the SDK's own reset to ``auto``,
SmolLM2-135M calls the tool again, turn after turn), and the tool's argument is an enum: the round
trip does not depend on a lucky sample. The argument is a Pydantic model, so the tool's schema
carries ``$defs``."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401  (fixture)
from pydantic import BaseModel, ConfigDict

agents = pytest.importorskip("agents")

MODEL = "smollm2"
CITIES = ["Rome", "Paris", "London"]


class Place(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Rome", "Paris", "London"]


@pytest.fixture(scope="module")
def server(smollm2_model):  # noqa: F811
    with live_server(smollm2_model) as srv:
        yield srv


@pytest.fixture(scope="module", autouse=True)
def no_tracing():
    # The SDK would send traces to OpenAI's servers; a test run reaches none.
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


def _run_agent(server, model_class: type) -> tuple[list[str], agents.RunResult]:
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool
    def get_weather(place: Place) -> str:
        """The current weather in a city."""
        calls.append(place.city)
        return f"Sunny and 21 degrees in {place.city}."

    class AnswerAfterTheTool(agents.AgentHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    client = AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the get_weather tool.",
        tools=[get_weather],
        model=model_class(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0.0, tool_choice="required", max_tokens=40),
        reset_tool_choice=False,
        hooks=AnswerAfterTheTool(),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Rome?", max_turns=4)
    return calls, result


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_an_agent_calls_its_tool_and_answers(server, model_class):
    calls, result = _run_agent(server, getattr(agents, model_class))
    assert len(calls) == 1 and calls[0] in CITIES, calls
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    call = result.new_items[0].raw_item
    assert call.name == "get_weather" and json.loads(call.arguments) == {"place": {"city": calls[0]}}
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
