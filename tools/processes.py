"""Upstream server processes end with commitgate, however commitgate ends.

The MCP SDK starts a stdio server in a session (and process group) of its own and, when the
connection closes, closes its stdin, waits, then signals the group. Two ways still left servers
running, re-parented to init: a server that exits while a child it started lives on in its group,
and commitgate stopped (a client's SIGTERM after closing stdin) while the SDK still waits for a hung
server. So each stdio server's process group is recorded when it starts (`recording`), signalled
once its connection has closed (`end`), and every group still recorded is ended when commitgate
shuts its upstreams down on a SIGTERM (`ended_on_sigterm`) or exits (atexit).

The SDK offers no hook for the spawned process: its spawn function is wrapped once, and records
the pid only inside `recording`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, TextIO

from mcp.client import stdio as sdk_stdio

log = logging.getLogger("commitgate.tools.processes")

_live: set[int] = set()  # process groups of stdio servers not yet ended
_recording: ContextVar[list[int] | None] = ContextVar("commitgate_upstream_spawns", default=None)


def _wrap_spawn() -> None:
    spawn = getattr(sdk_stdio, "_create_platform_compatible_process", None)
    if spawn is None or getattr(spawn, "_commitgate_records", False):
        return

    async def recorded(*args: Any, **kwargs: Any) -> Any:
        process = await spawn(*args, **kwargs)
        pids = _recording.get()
        if pids is not None and os.name == "posix":  # started with start_new_session: pgid == pid
            pids.append(process.pid)
            _live.add(process.pid)
        return process

    recorded._commitgate_records = True  # type: ignore[attr-defined]
    sdk_stdio._create_platform_compatible_process = recorded


_wrap_spawn()
atexit.register(lambda: end_all(signal.SIGKILL))


def stderr_for_children() -> TextIO:
    """Where an upstream process's stderr goes: ours, or /dev/null when ours is not a real file.

    A child needs a file descriptor; under a notebook, a test's captured output or an embedding
    host, sys.stderr may have none and the spawn would fail with "fileno"."""
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if stream is not None:
                stream.fileno()
                return stream
    return _devnull()


@functools.cache
def _devnull() -> TextIO:
    return open(os.devnull, "w")  # one for the process, never closed


@contextlib.contextmanager
def recording(pids: list[int]) -> Iterator[None]:
    """Append to `pids` the process group of each stdio server started within the block."""
    token = _recording.set(pids)
    try:
        yield
    finally:
        _recording.reset(token)


def end(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """Signal the process groups in `pids` (what is left of them: the SDK has stopped the servers)."""
    for pid in pids:
        _live.discard(pid)
        _signal_group(pid, sig)


def end_all(sig: int) -> None:
    for pid in list(_live):
        _live.discard(pid)
        _signal_group(pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def ended_on_sigterm() -> Iterator[None]:
    """While upstreams shut down: a SIGTERM ends their process groups at once (the shutdown then
    finishes without waiting out a hung server) instead of ending commitgate and orphaning them; a
    second SIGTERM ends commitgate as usual."""
    if os.name != "posix" or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        log.info("SIGTERM while stopping upstream servers: ending their processes now")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        end_all(signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
