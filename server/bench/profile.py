"""Where a server's Python time goes, by room: py-spy's samples reduced to shares of the call's path.

The bench starts a server as py-spy's child (`py-spy record --format raw --gil --nonblocking -- python
...`): a parent may read its child's memory without root. `--gil` keeps only the samples of the
thread holding the interpreter lock, the one time that a single-process Python server cannot
overlap; `--nonblocking` reads the server without pausing it.

Each sample goes to the room of the innermost frame that belongs to one: a library the server calls
(pydantic, json, sqlite3) counts for the room that called it, and asyncio's and anyio's code for the
event loop only when no other room's frame is on the stack. Samples of imports are left out: they
are the server starting, not serving.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# The rooms of a call's path, in the order a call meets them.
ROOMS = {
    "http_transport": "HTTP transport (uvicorn, h11, Starlette, the MCP SDK)",
    "mcp_surface": "MCP surface (commitgate's serve layer)",
    "commit_boundary": "commit boundary (commitgate's core)",
    "ledger": "ledger (its writer thread and its reads)",
    "receipts": "receipts and outbox events",
    "event_loop": "event loop (asyncio and anyio scheduling, waking and cancelling tasks)",
    "other": "other (start-up, and code of no room above)",
}
_TRANSPORT = {"uvicorn", "h11", "httptools", "starlette", "sse_starlette", "mcp"}
# The event loop's own code: its room only when no frame of another room called it (a task's callback).
_EVENT_LOOP = {"asyncio", "anyio", "selectors.py"}
# commitgate's folders, most specific first: a path relative to the package or the source tree.
_COMMITGATE = (
    ("server/ledger/evidence", "receipts"),
    ("server/model/receipts", "receipts"),
    ("server/ledger/", "ledger"),
    ("server/core/", "commit_boundary"),
    ("server/serve/", "mcp_surface"),
)
_FRAME_FILE = re.compile(r"\((?P<file>.*):\d+\)$")
_SITE = re.compile(r"^.*/(?:site|dist)-packages/")


def py_spy() -> str | None:
    """py-spy beside this interpreter (the bench's extra installs it there), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record_argv(py_spy_path: str, out: Path) -> list[str]:
    """The prefix that runs a command as py-spy's child, its samples written raw to `out` at its end."""
    return [py_spy_path, "record", "--format", "raw", "--gil", "--nonblocking", "--output", str(out), "--"]


def room_of(file: str) -> str | None:
    """The room a source file belongs to, or None for a library that counts for its caller. py-spy
    names a file relative to the folder it was imported from, or in full."""
    path = _SITE.sub("", file)
    if path.split("/", 1)[0] in _TRANSPORT:
        return "http_transport"
    path = path.removeprefix("commitgate/")
    for folder, room in _COMMITGATE:
        if path.startswith(folder) or f"/{folder}" in path:
            return room
    return None


def room_of_stack(frames: list[str]) -> str | None:
    """The room of one sample (outermost frame first); None for a sample taken during an import."""
    room, fallback = None, "other"
    for frame in frames:
        match = _FRAME_FILE.search(frame)
        if match is None:
            continue
        if frame.startswith("_find_and_load "):
            return None
        room = room_of(match["file"]) or room
        if match["file"].split("/", 1)[0] in _EVENT_LOOP:
            fallback = "event_loop"
    return room or fallback


def shares(raw: Iterable[str]) -> dict[str, Any]:
    """py-spy's raw lines (`frame;frame;... count`) as each room's share of the samples kept."""
    counts: Counter[str] = Counter()
    for line in raw:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        room = room_of_stack(stack.split(";"))
        if room is not None:
            counts[room] += int(count)
    total = sum(counts.values())
    return {
        "samples": total,
        "rooms": {room: round(counts[room] / total, 3) if total else 0.0 for room in ROOMS},
    }
