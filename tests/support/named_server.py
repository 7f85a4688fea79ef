"""An MCP server whose tools are whatever a JSON file lists, to wrap with `commitgate policy init`.

    python named_server.py NAME TOOLS.json          # stdio
    python named_server.py NAME TOOLS.json http     # streamable HTTP on a free port; prints its URL

TOOLS.json is a list of `{"name": ..., "annotations": {...}}` (wire names), read once at start: edit it
and restart the server and it offers other tools (an upgrade that added or dropped one). Every call
appends one JSON line `{"server", "tool", "note"}` to `$EFFECTS` and answers the note.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

NAME, SPEC = sys.argv[1], Path(sys.argv[2])
mcp = MCPServer(f"named-{NAME}")


def _tool(name: str) -> Callable[[str], str]:
    def call(note: str = "") -> str:
        with open(os.environ["EFFECTS"], "a", encoding="utf-8") as log:
            log.write(json.dumps({"server": NAME, "tool": name, "note": note}) + "\n")
        return note

    return call


for spec in json.loads(SPEC.read_text(encoding="utf-8")):
    declared = ToolAnnotations.model_validate(spec["annotations"]) if "annotations" in spec else None
    mcp.add_tool(_tool(spec["name"]), name=spec["name"], annotations=declared)


def serve_http() -> None:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    app = mcp.streamable_http_app(streamable_http_path="/mcp")
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    if sys.argv[3:4] == ["http"]:
        serve_http()
    else:
        mcp.run()
