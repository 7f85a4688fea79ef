"""A plain MCP SDK server with one no-op tool over stdio: what `commitgate bench` compares a guarded call with.

    python -m commitgate.tools.plain_server

No commitgate anywhere: the SDK's `MCPServer` and its own stdio transport, so
the benchmark can put a guarded commitgate call beside what any MCP server costs.
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

server = MCPServer("plain-noop", version="1.0.0")


@server.tool()
async def noop(n: int) -> dict[str, int]:
    """Do nothing and return `n`."""
    return {"n": n}


def main() -> None:
    server.run("stdio")


if __name__ == "__main__":
    main()
