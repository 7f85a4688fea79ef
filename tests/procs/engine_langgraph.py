"""LangGraph in the engine worker: a scripted model asks for one tool call, ToolNode runs it.

See engine_worker.py. The graph checkpoints into SQLite with `durability="sync"`: the model's
tool call is durable before the tool runs (docs/frameworks.md#langgraph says why that matters).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Annotated, Any

import engine_common as common
import langchain_core.tracers.run_collector  # what a run imports: once here, before the forks
import langchain_core.tracers.stdout  # noqa: F401
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from tools_e2e import engines

import commitgate.client.langgraph as cg_langgraph
from commitgate.client.gate import ToolCaller

CLIENT: ToolCaller | None = None


@tool
async def ship(order: str, tool_call_id: Annotated[str, InjectedToolCallId], config: RunnableConfig) -> str:
    """Ship the order."""
    if CLIENT is not None:
        result = await cg_langgraph.call(
            CLIENT, "ship", {"order": order}, config=config, tool_call_id=tool_call_id
        )
        shipped = result.structured or {}
    else:
        shipped = engines.ship(order)
    common.CURRENT.kill.arm()
    return json.dumps(shipped)


def model(state: MessagesState) -> dict[str, Any]:
    """A scripted model: a tool call with a fresh id (as a real model's), then a final answer."""
    last = state["messages"][-1]
    if isinstance(last, ToolMessage):
        return {"messages": [AIMessage(f"done: {last.content}")]}
    order = str(last.content).removeprefix("ship ")
    call = {"name": "ship", "args": {"order": order}, "id": f"call_{os.urandom(12).hex()}"}
    return {"messages": [AIMessage("", tool_calls=[call])]}


GRAPH = StateGraph(MessagesState)
GRAPH.add_node("model", model)
GRAPH.add_node("tools", ToolNode([ship]))
GRAPH.add_edge(START, "model")
GRAPH.add_conditional_edges("model", tools_condition)
GRAPH.add_edge("tools", "model")


async def run_graph(phase: str) -> None:
    global CLIENT
    order = common.CURRENT.order
    async with contextlib.AsyncExitStack() as stack:
        path = str(common.CURRENT.root / f"langgraph-{order}.sqlite")
        saver = await stack.enter_async_context(AsyncSqliteSaver.from_conn_string(path))
        put_writes = saver.aput_writes

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            common.CURRENT.kill.at_record()
            return await put_writes(*args, **kwargs)

        saver.aput_writes = recorded  # type: ignore[method-assign]  # its write of a node's result, hooked
        if common.CURRENT.gate:
            CLIENT = await stack.enter_async_context(common.commitgate_client())
        graph = GRAPH.compile(checkpointer=saver)
        config: RunnableConfig = {"configurable": {"thread_id": order}}
        first = None if phase == "resume" else MessagesState(messages=[HumanMessage(f"ship {order}")])
        final = await graph.ainvoke(first, config, durability="sync")
        assert str(final["messages"][-1].content).startswith("done:"), final


def run(phase: str) -> None:
    asyncio.run(run_graph(phase))
