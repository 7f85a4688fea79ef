"""A stdio MCP server built on the 1.x SDK (run by the Python of `.venv-sdk1`), as many servers
people run still are: `ping` answers pong."""

from mcp.server.fastmcp import FastMCP  # type: ignore[attr-defined]  # the 1.x SDK's name

mcp = FastMCP("sdk1")


@mcp.tool()
def ping() -> str:
    """Answer pong (no effect)."""
    return "pong"


if __name__ == "__main__":
    mcp.run()
