"""The MCP surface: a low-level MCP server over the gateway, what runs beside it, and stdio.

The low-level server is used because tools come from a policy as raw JSON schemas and may change
while serving. Protocol errors (unknown tool) are JSON-RPC errors; everything the model should
read is an `isError` result rendered by the gateway. Every transport gets the same server (the
per-call wrappers of calls.py included) and the same duties beside it (`serving`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import typing
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import mcp.types as types
from mcp import MCPError
from mcp.server import Server, ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions

from commitgate.server.serve import asking, callers, calls, passthrough, tracing
from commitgate.server.serve.auth import principal_of_request
from commitgate.server.serve.envelope import Call, Generation, Reply
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.notify import delivering
from commitgate.server.serve.reload import ToolListAnnouncer, policy_watcher, upstream_refresher

log = logging.getLogger("commitgate.surface")


def build_server(
    gateway: Gateway,
    version: str = "",
    *,
    announcer: ToolListAnnouncer | None = None,
) -> GatewayServer:
    def unknown(call: Call) -> MCPError:
        return MCPError(types.INVALID_PARAMS, f"Unknown tool: {call.name}")

    async def answer(call: Call) -> Reply:
        if not gateway.has_tool(call.name, call.generation):
            raise unknown(call)
        return await handler(call)

    handler = gateway.handler()
    served = calls.observed(calls.limited(answer), gateway)
    rounds = callers.Rounds() if passthrough.has_upstreams(gateway) else None

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=gateway.list_tools())

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        principal = principal_of_request()
        channel = asking.channel_of(ctx, params)  # how to ask for an approval

        async def run() -> types.CallToolResult | types.InputRequiredResult:
            return await served(gateway.envelope(params.name, params.arguments, ctx.meta, principal, channel))

        # An upstream's questions, progress and logs while serving the call reach this client only.
        return typing.cast(Any, await callers.relayed_call(ctx, params, run, rounds))

    server = GatewayServer(
        gateway.policy.server.name,
        version=version,
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        get_tool_input_schema=input_schemas(gateway),
    )
    server.answer_call = served  # the same chain for the lean HTTP path (http_calls.py)
    if announcer is not None:  # a policy edit announces tools/list_changed in both protocol eras
        announcer.install(server)
    if passthrough.has_upstreams(gateway):  # resources, prompts, completions, logging of the upstreams
        passthrough.Passthrough(gateway, announcer).install(server)
    # Seals the state of a call that asks the client's user for an approval (2026-07-28).
    server.middleware.append(
        asking.request_state_boundary(gateway.policy.server.name, lambda: principal_of_request())
    )
    tracing.install(server)  # commitgate's view on the SDK's tools/call span, when tracing is on
    return server


def input_schemas(gateway: Gateway) -> Callable[[str], Mapping[str, Any] | None]:
    """A tool's input schema by name, as tools/list gives it (one listing for every caller).

    Streamable HTTP's 2026-07-28 path checks a tools/call's `Mcp-Param-*` headers against the tool's
    schema before dispatch; without this lookup it finds the schema by running a whole tools/list
    request through the server on every call, which cost a guarded call more than its guard."""
    schemas: dict[str, Mapping[str, Any]] = {}
    indexed: list[Generation] = []

    def lookup(name: str) -> Mapping[str, Any] | None:
        generation = gateway.generation
        if not indexed or indexed[0] is not generation:  # a reload swaps the generation whole
            schemas.clear()
            schemas.update((tool.name, tool.input_schema) for tool in generation.listed)
            indexed[:] = [generation]
        return schemas.get(name)

    return lookup


INSTRUCTIONS = (
    "Tools that change something take an idempotency_key. Use a new key for each new action and the same key "
    "when retrying that action: the retry returns the first outcome instead of acting twice. If an answer is "
    "lost or says operation_in_progress, poll get_operation_status with the key instead of calling again; "
    "follow its retry_advice. list_operations shows what you already did."
)


class GatewayServer(Server[Any]):
    """The low-level MCP server over the gateway, with its tools/call chain (`answer_call`).

    Advertises `tools.listChanged: true` (a policy edit announces it) on every transport, and
    `listChanged` of resources and prompts when it passes an upstream's on.

    The streamable-HTTP session manager asks the server for its default initialization options
    and takes no options of its own, so the default has to say it.
    """

    passes_through = False  # serves the upstreams' resources and prompts (passthrough.py)
    answer_call: calls.Handler | None = None  # what answers a tools/call, wrapped as calls.py says

    def create_initialization_options(
        self, notification_options: NotificationOptions | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        options = notification_options or _notification_options(self)
        return super().create_initialization_options(options, *args, **kwargs)


def _notification_options(server: Server[Any]) -> NotificationOptions:
    relayed = getattr(server, "passes_through", False)
    return NotificationOptions(tools_changed=True, prompts_changed=relayed, resources_changed=relayed)


def initialization_options(server: Server[Any]) -> Any:
    return server.create_initialization_options(_notification_options(server))


@contextlib.asynccontextmanager
async def serving(gateway: Gateway, announcer: ToolListAnnouncer) -> AsyncIterator[None]:
    """What runs beside any transport: the boundary's duties (leases, sweeps; on the way out, the
    drain of in-flight operations into the ledger), the policy watcher and the upstream refresher."""
    try:
        async with (
            gateway.boundary.running(),
            policy_watcher(gateway, announcer.announce),
            upstream_refresher(gateway, announcer.announce),
            delivering(gateway.ledger, lambda: gateway.policy),
        ):
            yield
    finally:
        announcer.close()


async def serve_stdio(gateway: Gateway, version: str = "", transport: str = "fast") -> None:
    """`transport="fast"` (the default) serves the lean asyncio streams of stdio.py; "sdk" the SDK's."""
    from commitgate.server.serve.stdio import fast_stdio_server, sdk_stdio_server

    stdio_server = fast_stdio_server if transport == "fast" else sdk_stdio_server

    announcer = ToolListAnnouncer()
    server = build_server(gateway, version, announcer=announcer)
    async with serving(gateway, announcer), stdio_server() as (read, write):
        with _stop_on_sigterm():
            await server.run(read, write, initialization_options(server))


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """SIGTERM stops serving the way SIGINT does: the serving task is cancelled, and leaving
    `boundary.running()` lets the operations in flight record their outcome before the exit.
    (By default SIGTERM ends the process at once and leaves them RUNNING, later UNKNOWN.)"""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError):  # Windows' event loop: no signal handlers
        yield
        return
    try:
        yield
    finally:
        # Stopping already (end of input, or this very signal): a SIGTERM now, such as a client's
        # after its grace period, must not cut short the drain and the upstreams' close, or they
        # are left writing into a closed pipe. The handler goes with the event loop.
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
