"""A small annotated MCP server, as the servers people run in their clients declare their tools.

    python annotated_server.py NAME            # stdio
    python annotated_server.py NAME http       # streamable HTTP on a free port; prints its URL

Its tools: `read_NAME` (readOnlyHint), `write` (a name every such server shares; destructiveHint, no
readOnlyHint) and `plain_NAME` (no annotations). Every `write` appends one JSON line to `$EFFECTS`:
which server ran it, the note, and whether it saw its secret `s3cret-NAME` (in `$API_TOKEN` over
stdio, as `Authorization: Bearer s3cret-NAME` over HTTP).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

NAME = sys.argv[1]
mcp = MCPServer(f"annotated-{NAME}")


def _effects() -> list[dict[str, Any]]:
    try:
        with open(os.environ["EFFECTS"], encoding="utf-8") as log:
            return [json.loads(line) for line in log]
    except FileNotFoundError:
        return []


def _saw_secret(ctx: Context) -> bool:
    secret = f"s3cret-{NAME}"
    return (
        os.environ.get("API_TOKEN") == secret
        or (ctx.headers or {}).get("authorization") == f"Bearer {secret}"
    )


@mcp.tool(name=f"read_{NAME}", annotations=ToolAnnotations(readOnlyHint=True, title=f"Read {NAME}"))
def read() -> int:
    """How many writes this server made."""
    return sum(1 for effect in _effects() if effect["server"] == NAME)


@mcp.tool(annotations=ToolAnnotations(destructiveHint=True, idempotentHint=True))
def write(note: str, ctx: Context) -> dict[str, Any]:
    """Write a note (the side effect)."""
    entry = {"server": NAME, "note": note, "saw_secret": _saw_secret(ctx)}
    with open(os.environ["EFFECTS"], "a", encoding="utf-8") as log:
        log.write(json.dumps(entry) + "\n")
    return entry


@mcp.tool(name=f"plain_{NAME}")
def plain() -> str:
    """Answer with the server's name; declares nothing."""
    return NAME


def serve_http() -> None:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    app = mcp.streamable_http_app(streamable_http_path="/mcp")
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    if sys.argv[2:3] == ["http"]:
        serve_http()
    else:
        mcp.run()
