"""OpenAI Agents SDK: the run id in `_meta` on every MCP call, and commitgate's words when a call fails.

    from agents.mcp import MCPServerStdio
    from commitgate.client.openai_agents import commitgate_options

    server = MCPServerStdio({"command": COMMITGATE, "args": ["serve"]}, **commitgate_options(run_id))

The model keeps sending `idempotency_key` as an argument: the SDK gives the model the tool's
schema, in which the key is required, and a `_meta` resolver sees only a copy of the arguments, so
it cannot take the key out; a step sent beside a different key would be refused. Duplicate
detection catches a re-issue under a new key. Why each option is set: docs/frameworks.md#openai-agents-sdk.
"""

from __future__ import annotations

from typing import Any

from agents import RunContextWrapper
from agents.exceptions import ModelBehaviorError, UserError
from agents.mcp import MCPToolMetaContext, MCPToolMetaResolver

from commitgate.client.gate import SESSION_META
from commitgate.client.text import error_of, lost_answer_text, refusal_text


def meta_resolver(run_id: str) -> MCPToolMetaResolver:
    """`tool_meta_resolver`: every call of the run carries the run id as commitgate's session."""

    def resolve(context: MCPToolMetaContext) -> dict[str, Any]:
        return {SESSION_META: run_id}

    return resolve


def failure_error_function(context: RunContextWrapper[Any], error: Exception) -> str:
    """What the model reads when a call raised, instead of the SDK's fixed "An error occurred while
    running the tool. Please try again.", which invites a re-issue under a new key.

    commitgate's refusals arrive as results, not exceptions; what raises is the model's own mistake
    (said as it is) or a call whose answer was lost (a timeout, a dropped connection), where the
    model needs to hear that the call may have run and how to find out.
    """
    message = str(getattr(error, "message", None) or error) or type(error).__name__
    if isinstance(error, ModelBehaviorError | UserError):
        return message
    refusal = error_of(message)
    return refusal_text(refusal) if refusal is not None else lost_answer_text(message)


def commitgate_options(run_id: str) -> dict[str, Any]:
    """Keyword arguments for any `agents.mcp` server class (stdio, streamable HTTP, SSE)."""
    return {"tool_meta_resolver": meta_resolver(run_id), "failure_error_function": failure_error_function}
