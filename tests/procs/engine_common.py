"""What the durable-engine worker's runs share: the kill point, the run's mode, the commitgate client.

See engine_worker.py. Each forked child sets `CURRENT` before it runs the engine's workflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

TLS = ssl.create_default_context()  # built once before the forks: each child saves loading the CA file


class KillPoint:
    """Where this run dies: see the module docstring. None: count the window, do not die."""

    def __init__(self, root: Path, order: str, point: int | None, *, inert: bool = False) -> None:
        self.root = root
        self.order = order
        self.point = point
        self.events = 0
        self.armed = False
        self.inert = inert  # a resumed run: runs to its end

    def arm(self) -> None:
        """The tool answered: the effect has landed and the engine has not recorded it yet."""
        if self.inert or self.point == 0 or self.armed:
            return
        self.armed = True
        sys.setprofile(self._tick)

    def _tick(self, frame: FrameType, event: str, arg: object) -> None:
        self.events += 1
        if self.point is not None and self.events >= self.point:
            self._die("call event")

    def at_record(self) -> None:
        """The engine starts writing the step's result: the latest point where a crash loses it."""
        if not self.armed:
            return
        sys.setprofile(None)
        self.armed = False
        if self.point is None:
            (self.root / f"window-{self.order}").write_text(str(self.events))
        else:
            self._die("engine write")

    def _die(self, where: str) -> None:
        sys.setprofile(None)
        (self.root / f"killed-{self.order}").write_text(json.dumps({"where": where, "events": self.events}))
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Run:
    """One forked run: its order, whether it calls the tool directly or through commitgate, its kill point."""

    root: Path
    order: str
    gate: bool  # through commitgate at `url`, or the tool called in this process
    url: str
    kill: KillPoint


CURRENT = Run(Path(), "", False, "", KillPoint(Path(), "", None, inert=True))  # set by each forked child


@contextlib.asynccontextmanager
async def commitgate_client() -> AsyncIterator[Client]:
    async with (
        # No idle connections kept: on a loaded machine one can sit past the server's keep-alive
        # timeout and be closed just as it is reused, which no kill point is about.
        httpx2.AsyncClient(
            timeout=httpx2.Timeout(30, read=120),
            verify=TLS,
            limits=httpx2.Limits(max_keepalive_connections=0),
        ) as http,
        Client(streamable_http_client(CURRENT.url, http_client=http)) as client,
    ):
        yield client
