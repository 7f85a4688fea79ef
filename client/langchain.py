"""LangChain / LangGraph: MCP tools bound to one session for the whole run, with run id and step in `_meta`.

    from langchain_mcp_adapters.client import MultiServerMCPClient
    from commitgate.client.langchain import commitgate_session, load_commitgate_tools

    client = MultiServerMCPClient({"commitgate": {"transport": "stdio", "command": COMMITGATE, "args": ["serve"]}})
    async with commitgate_session(client) as session:       # one server process for the run
        tools = await load_commitgate_tools(session, run_id=thread_id)
        ...  # build and run the agent or graph inside this block

`client.get_tools()` would instead give tools that start a new session, hence a new commitgate
process and its upstreams, for every call. The adapters' interceptors can change headers but not
`_meta`, so the session itself is wrapped: its `call_tool` adds session and step. `commitgate_session`
is `client.session(name)` closed without the 1.x SDK's shutdown race (below). Why:
docs/frameworks.md#langchain-and-langgraph.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from langchain_core.tools import BaseTool
from langchain_mcp_adapters.tools import load_mcp_tools

from commitgate.client.keys import StepFunction, prepare

log = logging.getLogger("commitgate.client.langchain")


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


@asynccontextmanager
async def commitgate_session(client: Any, server_name: str = "commitgate") -> AsyncIterator[Any]:
    """`client.session(server_name)`, whose close never fails on the MCP SDK 1.x stdio race.

    The 1.x stdio client closes the session's read stream before it closes the server's stdin, and
    its stdout reader does not expect that: a message the server sent in between (a
    `tools/list_changed` as an upstream comes up, say) raises `anyio.BrokenResourceError` out of
    the `async with`, after the run's work is done and recorded. That error alone, raised at the
    close, is dropped here (the SDK's 2.x line closes cleanly); any other error is raised as it is.
    """
    try:
        async with client.session(server_name) as session:
            yield session
    except BaseExceptionGroup as group:
        raised = _without_close_race(group)
        if raised is not None:
            raise raised from None
        log.debug("dropped the MCP SDK's BrokenResourceError at the close of the %s session", server_name)


def _without_close_race(group: BaseExceptionGroup[Any]) -> BaseException | None:
    """What is left of `group` without the reader's BrokenResourceError; a lone error unwrapped."""
    _, rest = group.split(anyio.BrokenResourceError)
    if rest is None:
        return None
    while isinstance(rest, BaseExceptionGroup) and len(rest.exceptions) == 1:
        rest = rest.exceptions[0]
    return rest
