"""LangChain / LangGraph: MCP tools bound to one session for the whole run, with run id and step in `_meta`.

    from langchain_mcp_adapters.client import MultiServerMCPClient
    from commitgate.client.langchain import load_commitgate_tools

    client = MultiServerMCPClient({"commitgate": {"transport": "stdio", "command": COMMITGATE, "args": ["serve"]}})
    async with client.session("commitgate") as session:     # one server process for the run
        tools = await load_commitgate_tools(session, run_id=thread_id)
        ...  # build and run the agent or graph inside this block

`client.get_tools()` would instead give tools that start a new session, hence a new commitgate
process and its upstreams, for every call. The adapters' interceptors can change headers but not
`_meta`, so the session itself is wrapped: its `call_tool` adds session and step. Why: docs/frameworks.md#langchain-and-langgraph.
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import BaseTool
from langchain_mcp_adapters.tools import load_mcp_tools  # pyright: ignore[reportMissingImports] (needs mcp<2: not in the dev venv)

from commitgate.client.keys import StepFunction, prepare


class RunSession:
    """An MCP `ClientSession` whose tool calls carry the run id (and a step) in `_meta`."""

    def __init__(self, session: Any, run_id: str, step: StepFunction | None = None) -> None:
        self._session = session
        self.run_id = run_id
        self.step = step

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        sent, meta = prepare(name, arguments or {}, self.run_id, self.step)
        return await self._session.call_tool(
            name, sent, *args, meta={**(kwargs.pop("meta", None) or {}), **meta}, **kwargs
        )

    def __getattr__(self, name: str) -> Any:  # everything else is the session's own
        return getattr(self._session, name)


async def load_commitgate_tools(
    session: Any, *, run_id: str, step: StepFunction | None = None, **options: Any
) -> list[BaseTool]:
    """LangChain tools for every tool of the session's server, calling through `session` (kept open by
    the caller for the whole run). Options pass through to `load_mcp_tools`."""
    return await load_mcp_tools(RunSession(session, run_id, step), **options)
