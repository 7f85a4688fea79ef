"""DBOS: guarded calls keyed by the workflow's id and the step's id.

    from anyio.from_thread import start_blocking_portal
    from commitgate.client.dbos import DBOSGate

    with start_blocking_portal() as portal, portal.wrap_async_context_manager(client) as session:
        gate = DBOSGate(portal, session)            # one MCP session for the whole application
        DBOS.launch()                               # recovers unfinished workflows, see below
        ...

    @DBOS.step()
    def ship(order: str) -> dict:
        return gate.call("ship", {"order": order}).structured

DBOS records a step's output when the step returns. A process that dies after the tool acted and
before that record is written runs the step again when DBOS recovers the workflow, with the same
workflow id and the same step id. `DBOSGate` sends those two as the operation's session and key,
so the step's second run gets the first outcome back from commitgate instead of acting again.

The MCP session lives on the portal's event loop, so steps can call it from any thread (sync
workflows run in DBOS's thread pool) or any event loop (recovered async workflows run on DBOS's
own loop, not on the one that started them). See docs/frameworks.md#dbos.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from functools import partial
from typing import Any

from anyio.from_thread import BlockingPortal
from dbos import DBOS

from commitgate.client.gate import Gate, GateResult, ToolCaller
from commitgate.client.keys import step_key


def identity(name: str) -> tuple[str, str]:
    """The session and key of action `name` in the DBOS step running now: its workflow id, its step id."""
    workflow_id, step_id = DBOS.workflow_id, DBOS.step_id
    if workflow_id is None or step_id is None:
        raise RuntimeError(
            "commitgate.client.dbos needs the DBOS step it runs in: call it from a function "
            "decorated with @DBOS.step(), not from the workflow's own body"
        )
    return workflow_id, step_key("dbos", step_id, name)


class DBOSGate:
    """Guarded calls from DBOS steps over one MCP session held by `portal`'s event loop."""

    def __init__(self, portal: BlockingPortal, client: ToolCaller, **gate_options: Any) -> None:
        self.portal = portal
        self.client = client
        self.gate_options = gate_options  # passed to each Gate: wait, backoff

    def call(self, tool: str, arguments: Mapping[str, Any] | None = None, *, name: str = "") -> GateResult:
        """Run `tool` once for this step (from a sync step). `name` tells apart two calls of one tool."""
        return self.portal.call(self._bound(tool, arguments, name))

    async def acall(
        self, tool: str, arguments: Mapping[str, Any] | None = None, *, name: str = ""
    ) -> GateResult:
        """As `call`, from an async step on whatever event loop DBOS runs it."""
        return await asyncio.wrap_future(self.portal.start_task_soon(self._bound(tool, arguments, name)))

    def _bound(self, tool: str, arguments: Mapping[str, Any] | None, name: str) -> partial[Any]:
        session, step = identity(name or tool)  # read here: DBOS's context does not cross to the portal
        gate = Gate(self.client, session=session, **self.gate_options)
        return partial(gate.call, tool, arguments, step=step)
