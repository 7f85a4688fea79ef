"""Walk one guarded call and print the rooms (the project's modules) it passes through.

    .venv/bin/python tests/support/walk_call.py [--json]

Serves a key-required no-op Python tool in this process, as `commitgate serve` builds it (a
gateway over the commit boundary, a durable SQLite ledger file, the MCP server of
serve/surface.py), and calls it from a real MCP client over in-memory streams. After a warm-up
call, one `tools/call` runs under `sys.setprofile`, which notes the module of the innermost
project frame after every Python call and return. Printed:

- rooms: distinct modules visited, and the folders they are in;
- transitions: moves from one room to another;
- returns: moves into a room that was visited before and left since (a hub and its spokes
  show up here: every trip back to the hub counts);
- the room sequence, consecutive repeats collapsed.

Only this thread is watched: the SQLite ledger's writer thread and the MCP client's own code (not
the project's) are outside the walk. The counts follow the code, not the clock, so two versions
of the code can be compared on a busy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from mcp import Client

from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.surface import build_server

ROOT = Path(__file__).resolve().parents[2]
# The checkout's folders that are importable as commitgate.* (src/commitgate/ links to them).
PROJECT = [link.resolve() for link in (ROOT / "src" / "commitgate").iterdir()]

POLICY = """
[ledger]
url = "sqlite:///{ledger}"
synchronous = "FULL"
[tools.noop]
class = "key-required"
python = "commitgate.server.bench.tools:noop"
retry = {{ attempts = 1 }}
"""


class RoomRecorder:
    """A `sys.setprofile` hook: the project module the thread is in, after each call and return."""

    def __init__(self) -> None:
        self.rooms: list[str] = []
        self._room_of: dict[str, str | None] = {}  # file name -> room (None: not the project's)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            self._enter(frame)
        elif event == "return":
            self._enter(frame.f_back)  # back in the caller, or the nearest project frame above it

    def _enter(self, frame: FrameType | None) -> None:
        while frame is not None:
            room = self._room(frame.f_code.co_filename)
            if room is not None:
                if not self.rooms or self.rooms[-1] != room:
                    self.rooms.append(room)
                return
            frame = frame.f_back

    def _room(self, filename: str) -> str | None:
        if filename not in self._room_of:
            path = Path(filename).resolve()
            inside = [folder for folder in PROJECT if path.is_relative_to(folder)]
            self._room_of[filename] = str(path.relative_to(ROOT).with_suffix("")) if inside else None
        return self._room_of[filename]


def summary(rooms: list[str]) -> dict[str, Any]:
    """Rooms, folders, transitions and returns to a room already left, from the collapsed walk."""
    seen: set[str] = set()
    returns = 0
    for room in rooms:
        returns += room in seen  # consecutive repeats are collapsed, so a room seen before was left
        seen.add(room)
    return {
        "rooms": len(seen),
        "folders": len({room.rpartition("/")[0] for room in seen}),
        "transitions": max(len(rooms) - 1, 0),
        "returns": returns,
        "walk": rooms,
    }


async def walk() -> list[str]:
    """The collapsed room sequence of one guarded tools/call, after a warm-up call."""
    with tempfile.TemporaryDirectory(prefix="commitgate-walk-") as tmp:
        policy = loads_policy(POLICY.format(ledger=Path(tmp) / "ledger.db"))
        gateway = await Gateway.open(policy, None)
        try:
            async with Client(build_server(gateway)) as client:
                await client.call_tool("noop", {"n": 0, "idempotency_key": "warm-up"})
                recorder = RoomRecorder()
                sys.setprofile(recorder)
                try:
                    result = await client.call_tool("noop", {"n": 1, "idempotency_key": "walked"})
                finally:
                    sys.setprofile(None)
                if result.is_error:
                    raise RuntimeError(f"the guarded no-op failed: {result.content}")
        finally:
            await gateway.close()
    return recorder.rooms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="walk_call.py", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures and the walk as JSON")
    args = parser.parse_args(argv)
    found = summary(asyncio.run(walk()))
    if args.json:
        print(json.dumps(found, indent=2))
        return
    print(f"rooms: {found['rooms']} modules in {found['folders']} folders")
    print(f"transitions: {found['transitions']}")
    print(f"returns to a room already left: {found['returns']}")
    print("walk: " + " > ".join(found["walk"]))


if __name__ == "__main__":
    main()
