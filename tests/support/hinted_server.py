"""An MCP server whose tools declare every kind of annotation, to stand upstream of commitgate.

    python hinted_server.py        # stdio

Its tools: `lookup` (read-only, titled, closed world), `erase` (destructive, open world, titled),
`note` (declares nothing) and `tally` (`idempotentHint` alone); `added_later` too when the file
`$HINTED_EXTRA` exists at start (a server that gained a tool, e.g. after an upgrade). Every call of a
tool with an effect appends one JSON line to `$HINTED_EFFECTS`. The server writes its pid to
`$HINTED_PID` when set, and with `$HINTED_SLOW` seconds it first sleeps that long before reading its
input, as a server `npx -y` is still installing does (with `$HINTED_GATE` it instead waits until that
file exists, so a test decides when the install ends); then it touches `$HINTED_PID.ready`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

mcp = MCPServer("hinted")


def _effect(tool: str, **fields: Any) -> dict[str, Any]:
    entry = {"tool": tool, **fields}
    with open(os.environ["HINTED_EFFECTS"], "a", encoding="utf-8") as log:
        log.write(json.dumps(entry) + "\n")
    return entry


@mcp.tool(annotations=ToolAnnotations(title="Look up", readOnlyHint=True, openWorldHint=False))
def lookup(name: str) -> str:
    """Look a name up (no effect)."""
    return f"found {name}"


@mcp.tool(
    title="Erase a record",
    annotations=ToolAnnotations(title="Erase", destructiveHint=True, openWorldHint=True),
)
def erase(name: str) -> dict[str, Any]:
    """Erase a record."""
    return _effect("erase", name=name)


@mcp.tool()
def note(text: str) -> dict[str, Any]:
    """Write a note."""
    return _effect("note", text=text)


@mcp.tool(annotations=ToolAnnotations(idempotentHint=True))
def tally(n: int) -> dict[str, Any]:
    """Add to a tally."""
    return _effect("tally", n=n)


def added_later(text: str) -> dict[str, Any]:
    """Write a note with the tool the server gained."""
    return _effect("added_later", text=text)


if __name__ == "__main__":
    if os.environ.get("HINTED_EXTRA") and Path(os.environ["HINTED_EXTRA"]).exists():
        mcp.tool()(added_later)
    pidfile = os.environ.get("HINTED_PID")
    if pidfile:
        Path(pidfile).write_text(str(os.getpid()))
    time.sleep(float(os.environ.get("HINTED_SLOW", "0")))
    gate = os.environ.get("HINTED_GATE")
    while gate and not Path(gate).exists():
        time.sleep(0.05)
    if pidfile:
        Path(f"{pidfile}.ready").touch()
    mcp.run()
