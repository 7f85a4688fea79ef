"""A plain MCP SDK server with one no-op tool: what `commitgate bench` compares a guarded call with.

    python -m commitgate.server.bench.plain_sdk                 # stdio
    python -m commitgate.server.bench.plain_sdk --http PORT     # streamable HTTP on 127.0.0.1:PORT/mcp

No commitgate anywhere: the SDK's `MCPServer` and its own transports, so the
benchmark can put a guarded commitgate call beside what any MCP server costs.
Its log level is WARNING, as commitgate's default: no access log line per request.
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer

server = MCPServer("plain-noop", version="1.0.0", log_level="WARNING")


@server.tool()
async def noop(n: int) -> dict[str, int]:
    """Do nothing and return `n`."""
    return {"n": n}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m commitgate.server.bench.plain_sdk")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    args = parser.parse_args(argv)
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
