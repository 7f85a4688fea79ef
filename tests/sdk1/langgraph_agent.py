"""A LangGraph agent run from a venv holding only commitgate-client, mcp<2 and langchain-mcp-adapters.

Run by tests/test_client_sdk1.py with that venv's Python (the Makefile builds `.venv-sdk1`) with a
JSON list of runs; it prints a JSON list of what each run's model read. The scripted model charges order 42, "loses" the answer and charges again
under a new key and tool-call id; all calls go through one MCP session over stdio, so one server
process serves the whole run. With a run id it goes through `commitgate.client.langchain` and
then (without a step) drives `Gate` on the same session: the client's own calls on the SDK's 1.x line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from importlib.metadata import version
from typing import Any

from langchain_core.messages import AIMessage, ToolMessage
from langchain_mcp_adapters.tools import load_mcp_tools  # pyright: ignore[reportMissingImports] (in .venv-sdk1 only)
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from commitgate.client import Gate, PossibleDuplicate
from commitgate.client.keys import by_arguments
from commitgate.client.langchain import load_commitgate_tools

CHARGE = {"card": "4242", "amount_cents": 1299, "description": "order 42"}


def scripted_model(calls: int) -> Any:
    def model(state: MessagesState) -> dict[str, Any]:
        made = sum(1 for m in state["messages"] if isinstance(m, AIMessage) and m.tool_calls)
        if made < calls:
            args = {**CHARGE, "idempotency_key": f"order-42-{uuid.uuid4().hex[:8]}"}  # the model lost track
            call = {"name": "charge_card", "args": args, "id": f"call_{made + 1}", "type": "tool_call"}
            return {"messages": [AIMessage(content="", tool_calls=[call])]}
        return {"messages": [AIMessage(content="Done.")]}

    return model


def agent(tools: list[Any], calls: int) -> Any:
    graph = StateGraph(MessagesState)
    graph.add_node("model", scripted_model(calls))
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition, ["tools", END])
    graph.add_edge("tools", "model")
    return graph.compile()


def text_of(message: ToolMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    return "\n".join(str(b.get("text", "")) if isinstance(b, dict) else str(b) for b in content)


async def gate_calls(session: ClientSession) -> dict[str, Any]:
    gate = Gate(session, session="gate-run")
    order = {**CHARGE, "description": "order 43"}
    first = await gate.call("charge_card", order, step="charge")
    again = await gate.call("charge_card", order, step="charge")
    try:
        await gate.call("charge_card", order, step="charge-under-another-name")
        duplicate = None
    except PossibleDuplicate as exc:
        duplicate = exc.duplicate_of.get("operation_id")
    return {
        "replayed": [first.replayed, again.replayed],
        "same": first.structured == again.structured,
        "operation_id": first.operation.get("operation_id"),
        "duplicate_of": duplicate,
    }


async def run(config: dict[str, Any]) -> dict[str, Any]:
    command = config["server"]
    params = StdioServerParameters(command=command[0], args=command[1:], env=config["env"])
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        run_id = config.get("run_id")
        step = by_arguments if config.get("step") else None
        tools = await (
            load_commitgate_tools(session, run_id=run_id, step=step) if run_id else load_mcp_tools(session)
        )
        state = await agent(tools, config["calls"]).ainvoke({"messages": [("user", "Charge order 42")]})
        seen = [m for m in state["messages"] if isinstance(m, ToolMessage)]
        out: dict[str, Any] = {
            "mcp": version("mcp"),
            "read": [text_of(m) for m in seen],
            "status": [m.status for m in seen],
        }
        if run_id and not step:
            out["gate"] = await gate_calls(session)
    return out


async def main(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several runs side by side, each with its own server process."""
    return list(await asyncio.gather(*(run(config) for config in configs)))


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
