"""A scripted model for the OpenAI Agents SDK, and one agent run with it over MCP stdio.

Apart from tests/test_agent_openai.py, which imports it inside its tests: the Agents SDK takes
seconds of CPU to import, and every pytest worker collects that module whether it runs it or not.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from agents import Agent, RunConfig, Runner
from agents.items import ModelResponse
from agents.mcp import MCPServerStdio, MCPServerStdioParams
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from support.agents import CHARGE


class ScriptedModel(Model):
    """Charges `calls` times, each under a new key and call id, then answers; keeps what it read."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.read: list[str] = []

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        items = [item for item in input if isinstance(item, dict)] if isinstance(input, list) else []
        made = [item for item in items if item.get("type") == "function_call"]
        self.read = [_text(item["output"]) for item in items if item.get("type") == "function_call_output"]
        if len(made) < self.calls:
            n = len(made) + 1
            arguments = json.dumps({**CHARGE, "idempotency_key": f"order-42-{uuid.uuid4().hex[:8]}"})
            call = ResponseFunctionToolCall(
                type="function_call",
                call_id=f"call_{n}",
                name="charge_card",
                arguments=arguments,
                id=f"fc_{n}",
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(type="output_text", text="Done.", annotations=[])
        message = ResponseOutputMessage(
            id="msg", type="message", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the scripted model answers whole responses only")


def _text(output: Any) -> str:
    if isinstance(output, list):
        return "\n".join(str(block.get("text", "")) for block in output if isinstance(block, dict))
    return str(output)


async def run_agent(command: list[str], env: dict[str, str], calls: int, **options: Any) -> ScriptedModel:
    model = ScriptedModel(calls)
    params: MCPServerStdioParams = {"command": command[0], "args": command[1:], "env": env}
    # A server process may take a few seconds to start on a busy machine.
    async with MCPServerStdio(params, client_session_timeout_seconds=30, **options) as server:
        agent = Agent(name="payments", model=model, mcp_servers=[server])
        await Runner.run(agent, "Charge order 42 for $12.99", run_config=RunConfig(tracing_disabled=True))
    return model
