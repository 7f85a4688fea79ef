"""pydantic-ai: an MCP toolset whose calls carry the run id (and a step) and whose refusals are final.

    from commitgate.client.pydantic_ai import commitgate_toolset

    toolset = commitgate_toolset(StdioTransport(COMMITGATE, ["serve"])  # the server's `commitgate` command, run_id=run_id)
    agent = Agent(model, toolsets=[toolset])

What pydantic-ai does by itself and why this changes it: docs/frameworks.md#pydantic-ai.
"""

from __future__ import annotations

from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.exceptions import ToolFailed
from pydantic_ai.mcp import CallToolFunc, MCPToolset, ProcessToolCallback

from commitgate.client.keys import StepFunction, prepare
from commitgate.client.text import readable


def process_tool_call(run_id: str, step: StepFunction | None = None) -> ProcessToolCallback:
    """A `process_tool_call` hook: session and step in `_meta`, refusals as commitgate's own text."""

    async def hook(ctx: RunContext[Any], call_tool: CallToolFunc, name: str, args: dict[str, Any]) -> Any:
        arguments, meta = prepare(name, args, run_id, step)
        try:
            return await call_tool(name, arguments, metadata=meta)
        except ToolFailed as failed:  # the message is the structured error, JSON-encoded
            raise ToolFailed(readable(failed.message)) from None

    return hook


def commitgate_toolset(
    server: Any, *, run_id: str, step: StepFunction | None = None, **options: Any
) -> MCPToolset:
    """An `MCPToolset` for a commitgate server (a transport, URL or FastMCP client, as MCPToolset takes).

    A refusal is the call's final answer (`tool_error_behavior="failed"`), not a retry that counts
    against the tool's retry budget; other `MCPToolset` options pass through.
    """
    options.setdefault("tool_error_behavior", "failed")
    return MCPToolset(server, process_tool_call=process_tool_call(run_id, step), **options)
