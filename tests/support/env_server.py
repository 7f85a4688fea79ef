"""A stdio MCP server that tells what environment it was started with (tests of `inherit_env`)."""

from __future__ import annotations

import os

from mcp.server.mcpserver import MCPServer

mcp = MCPServer("env-upstream")


@mcp.tool()
def environment() -> dict[str, str]:
    """The server's own environment variables."""
    return dict(os.environ)


if __name__ == "__main__":
    mcp.run()
