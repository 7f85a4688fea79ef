"""The MCP surface: a low-level MCP server over the gateway, and the stdio transport.

The low-level server is used because tools come from a policy as raw JSON
schemas and may change while serving (DESIGN notes §2). Protocol errors
(unknown tool) are JSON-RPC errors; everything the model should read is an
`isError` result rendered by the gateway.
"""

from __future__ import annotations

import logging
from typing import Any

import mcp.types as types
from mcp import MCPError
from mcp.server import Server, ServerRequestContext
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.lowlevel.server import NotificationOptions

from commitgate.server.serve.gateway import Gateway

log = logging.getLogger("commitgate.surface")


def principal_of_request() -> str | None:
    """The identity behind the bearer token on HTTP transports; None on stdio (the gateway's default)."""
    token = get_access_token()
    return token.client_id if token is not None else None


def build_server(gateway: Gateway, version: str = "") -> Server[Any]:
    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=gateway.list_tools())

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if not gateway.has_tool(params.name):
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}")
        meta: dict[str, Any] = dict(ctx.meta or {})
        return await gateway.call_tool(params.name, params.arguments, meta, principal_of_request())

    return Server(
        gateway.policy.server.name,
        version=version,
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


INSTRUCTIONS = (
    "Tools that change something take an idempotency_key. Use a new key for each new action and the same key "
    "when retrying that action: the retry returns the first outcome instead of acting twice. If an answer is "
    "lost or says operation_in_progress, poll get_operation_status with the key instead of calling again; "
    "follow its retry_advice. list_operations shows what you already did."
)


def initialization_options(server: Server[Any]) -> Any:
    return server.create_initialization_options(NotificationOptions(tools_changed=True))


async def serve_stdio(gateway: Gateway, version: str = "", transport: str = "fast") -> None:
    """`transport="fast"` (the default) serves the lean asyncio streams of fast_stdio.py; "sdk" the SDK's."""
    if transport == "fast":
        from commitgate.server.serve.stdio import fast_stdio_server as stdio_server
    else:
        from mcp.server.stdio import stdio_server

    from commitgate.server.serve.reload import ToolListAnnouncer, policy_watcher, upstream_refresher

    server = build_server(gateway, version)
    announcer = ToolListAnnouncer()  # a policy edit announces tools/list_changed in both eras
    announcer.install(server)
    try:
        async with (
            gateway.boundary.running(),
            policy_watcher(gateway, announcer.announce),
            upstream_refresher(gateway, announcer.announce),
            stdio_server() as (read, write),
        ):
            await server.run(read, write, initialization_options(server))
    finally:
        announcer.close()
