"""OpenAI Agents SDK end to end: a scripted model, MCP over stdio, charges counted in the system of record.

The model re-issues a charge under a new key after a lost answer: two charges through a plain MCP
server, one through commitgate, and the model reads commitgate's message as plain text.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, RunConfig, RunContextWrapper, Runner
from agents.items import ModelResponse
from agents.mcp import MCPServerStdio, MCPServerStdioParams
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from support.agents import CHARGE, AgentSandbox

from commitgate.client.openai_agents import commitgate_options

pytestmark = pytest.mark.slow


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


@pytest.mark.anyio
async def test_without_commitgate_the_re_issue_charges_twice(tmp_path: Path) -> None:
    box = AgentSandbox.create(tmp_path / "plain")
    model = await run_agent(box.plain, box.env, calls=2)
    assert len(model.read) == 2 and all("charge_id" in text for text in model.read)
    assert box.charges() == 2


@pytest.mark.anyio
async def test_through_commitgate_it_charges_once_and_the_model_reads_why(tmp_path: Path) -> None:
    box = AgentSandbox.create(tmp_path / "guarded")
    model = await run_agent(box.commitgate, box.env, calls=3, **commitgate_options("run-1"))
    assert box.charges() == 1
    first, *refusals = model.read
    assert len(refusals) == 2
    for text in refusals:
        assert text.startswith("[possible_duplicate] Possible duplicate: nothing was executed now.")
        assert "in session 'run-1'" in text  # the run id reached commitgate in _meta
        assert json.loads(first)["charge_id"] in text
        assert '\\"' not in text and '{"error' not in text  # plain text, no JSON wrapped around it


def test_a_lost_answer_is_told_as_maybe_done_not_as_try_again() -> None:
    """What the SDK's default says when a call raises, and what the adapter says instead."""
    from agents.tool import default_tool_error_function

    from commitgate.client.openai_agents import failure_error_function

    context: RunContextWrapper[None] = RunContextWrapper(context=None)
    timeout = TimeoutError("Timed out while waiting for response to ClientRequest. Waited 30.0 seconds.")
    default = default_tool_error_function(context, timeout)
    assert default == "An error occurred while running the tool. Please try again."
    said = failure_error_function(context, timeout)
    assert said.startswith("No answer came back from the tool (Timed out while waiting")
    assert "The call may have run" in said and "the same idempotency_key" in said
