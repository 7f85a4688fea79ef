"""A small MCP server to stand upstream of commitgate in tests (stdio or streamable HTTP).

Every side-effecting tool appends one line to the JSONL file `$STUB_LOG`, with the `_meta` session
and step it received and whether the request carried `Authorization: Bearer $STUB_TOKEN`.

    python upstream_server.py                 # stdio
    python upstream_server.py http [PORT]     # streamable HTTP (default: a free port); prints its URL

Over HTTP with `$STUB_GATE` set, it listens only once that file exists (a server that comes up later).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

mcp = MCPServer("stub-upstream")


def _record(tool: str, ctx: Context, **fields: Any) -> int:
    meta = ctx.request_context.meta or {}
    token = os.environ.get("STUB_TOKEN")
    headers = ctx.headers or {}
    entry = {
        "tool": tool,
        "session": meta.get("commitgate/session"),
        "step": meta.get("commitgate/step"),
        "authorized": bool(token) and headers.get("authorization") == f"Bearer {token}",
        **fields,
    }
    with open(os.environ["STUB_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps(entry) + "\n")
        log.flush()
        os.fsync(log.fileno())
    with open(os.environ["STUB_LOG"], encoding="utf-8") as log:
        return sum(1 for _ in log)


@mcp.tool()
def record(note: str, ctx: Context) -> dict[str, Any]:
    """Record a note (the side effect)."""
    return {"note": note, "line": _record("record", ctx, note=note)}


@mcp.tool()
def record_keyed(note: str, idempotency_key: str, ctx: Context) -> dict[str, Any]:
    """Record a note; takes its own idempotency_key argument, as a commitgate server's tools do."""
    return {"note": note, "line": _record("record_keyed", ctx, note=note, key=idempotency_key)}


@mcp.tool()
def die_after_recording(note: str, ctx: Context) -> dict[str, Any]:
    """Record a note, then exit before answering: the caller cannot know it happened."""
    _record("die_after_recording", ctx, note=note)
    os._exit(3)


@mcp.tool()
def rate_limited(note: str) -> str:
    """Always refused as rate limited."""
    raise ToolError("rate limit exceeded, try again in a minute")


@mcp.tool()
def spend_then_fail(note: str, amount: int, ctx: Context) -> str:
    """Record a spend of `amount` (the side effect), then answer an error that echoes `note` back."""
    _record("spend_then_fail", ctx, note=note, amount=amount)
    raise ToolError(f"could not confirm {note}")


@mcp.tool()
def refuse(note: str) -> str:
    """Always refused for good."""
    raise ToolError(f"account for {note!r} is closed")


@mcp.tool()
def ping() -> str:
    """Answer pong (no side effect)."""
    return "pong"


def serve_http(port: int = 0) -> None:
    import uvicorn

    gate = os.environ.get("STUB_GATE")
    while gate and not os.path.exists(gate):  # started ahead, it listens only once the test opens the gate
        time.sleep(0.02)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    app = mcp.streamable_http_app(streamable_http_path="/mcp")
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        serve_http(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    else:
        mcp.run()
