"""One short LangGraph run through `commitgate.client.langchain`, from the venv on the MCP SDK's 1.x line.

Run by tests/test_client_sdk1.py with a JSON config: the server's command line and environment, and
whether to open the session with `commitgate_session` (else `client.session`, as the adapters'
README has it). The scripted model charges one order through a `ToolNode`, and the run ends: the
server's upstreams are still coming up, so `tools/list_changed` notifications arrive while the
session closes. Prints the ToolMessage statuses; the exit status is the run's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from langchain_core.messages import AIMessage, ToolMessage
from langchain_mcp_adapters.client import MultiServerMCPClient
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from commitgate.client.langchain import commitgate_session, load_commitgate_tools


def model(state: MessagesState) -> dict[str, Any]:
    if any(isinstance(m, ToolMessage) for m in state["messages"]):
        return {"messages": [AIMessage(content="Done.")]}
    args = {"card": "4242", "amount_cents": 1299, "description": "order 42", "idempotency_key": "order-42"}
    call = {"name": "charge_card", "args": args, "id": "call_1", "type": "tool_call"}
    return {"messages": [AIMessage(content="", tool_calls=[call])]}


async def run(config: dict[str, Any]) -> list[str]:
    command = config["server"]
    connection = {"transport": "stdio", "command": command[0], "args": command[1:], "env": config["env"]}
    client = MultiServerMCPClient({"commitgate": connection})
    opened = commitgate_session(client) if config["contained"] else client.session("commitgate")
    async with opened as session:
        tools = await load_commitgate_tools(session, run_id=config["run_id"])
        graph = StateGraph(MessagesState)
        graph.add_node("model", model)
        graph.add_node("tools", ToolNode(tools))
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", tools_condition, ["tools", END])
        graph.add_edge("tools", "model")
        compiled: Any = graph.compile()
        state = await compiled.ainvoke({"messages": [("user", "Charge order 42")]})
    return [m.status for m in state["messages"] if isinstance(m, ToolMessage)]


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(json.loads(sys.argv[1])))))
