"""LangGraph: guarded calls keyed by the thread id and the model's tool call id from the checkpoint.

    @tool
    async def ship(order: str, tool_call_id: Annotated[str, InjectedToolCallId], config: RunnableConfig) -> str:
        result = await commitgate.client.langgraph.call(client, "ship", {"order": order},
                                                        config=config, tool_call_id=tool_call_id)
        return result.text

LangGraph checkpoints the model's message, tool calls and their ids included, when the model's
node finishes. A process that dies while the tool node runs resumes from that checkpoint and runs
the tool node again from its start, with the same message: the same thread id and tool call id,
so commitgate answers the second run with the first outcome instead of acting again. This holds
when the model's checkpoint is written before the tools run: compile or invoke the graph with
`durability="sync"` (the default, "async", may still be writing it when the tool acts, and a
crash then re-asks the model, whose new tool call ids are new actions). See docs/frameworks.md#langgraph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from commitgate.client.gate import Gate, GateResult, ToolCaller
from commitgate.client.keys import step_key


def identity(config: Mapping[str, Any], tool_call_id: str) -> tuple[str, str]:
    """The session and key of a tool call: the run's thread id, the tool call's id."""
    thread_id = (config.get("configurable") or {}).get("thread_id")
    if not thread_id:
        raise ValueError(
            "commitgate.client.langgraph needs the run's thread id: invoke the graph with "
            'config={"configurable": {"thread_id": ...}} and a checkpointer'
        )
    if not tool_call_id:
        raise ValueError(
            "commitgate.client.langgraph needs the tool call's id: declare the tool's parameter as "
            "`tool_call_id: Annotated[str, InjectedToolCallId]` and let ToolNode call it"
        )
    return str(thread_id), step_key(tool_call_id)


async def call(
    client: ToolCaller,
    tool: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    config: Mapping[str, Any],
    tool_call_id: str,
    **gate_options: Any,
) -> GateResult:
    """Run `tool` once for this tool call of this thread, however often the node re-runs."""
    session, step = identity(config, tool_call_id)
    return await Gate(client, session=session, **gate_options).call(tool, arguments, step=step)
