"""Start or reach each server of a client config once and list its tools, all at the same time.

Each server gets one connection attempt bounded by the connect timeout (`npx -y` may be installing
it). What a stdio server writes on stderr goes to a file, so its last line can say why it failed; what
the MCP SDK logs about a server (a line on stdout that is not JSON-RPC, say) joins its reason, in one
line, rather than reaching the terminal as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TextIO

import httpx2
import mcp.types as types
from mcp import Client, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from commitgate.server.cli.client_configs import ServerEntry
from commitgate.server.cli.policy_writing import one_line
from commitgate.server.model.durations import format_duration
from commitgate.tools.upstream import handshake


@dataclass(frozen=True, slots=True)
class Listing:
    """What one server answered: its tools, or why there are none."""

    entry: ServerEntry
    tools: list[types.Tool]
    error: str | None = None


# What the SDK logged while listing one server (each server is listed in a task of its own).
_LOGGED: ContextVar[list[str] | None] = ContextVar("logged", default=None)


class _Collected(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logged = _LOGGED.get()
        if logged is not None and record.levelno >= logging.WARNING and len(logged) < 3:
            logged.append(" ".join(record.getMessage().split())[:200])


@contextlib.contextmanager
def _sdk_logs_collected() -> Iterator[None]:
    logger = logging.getLogger("mcp")
    handler, propagate = _Collected(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


async def list_all(entries: list[ServerEntry], connect_timeout: float) -> list[Listing]:
    with _sdk_logs_collected():
        return list(await asyncio.gather(*(_list_one(entry, connect_timeout) for entry in entries)))


async def _list_one(entry: ServerEntry, connect_timeout: float) -> Listing:
    logged: list[str] = []
    _LOGGED.set(logged)
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
        try:
            async with asyncio.timeout(connect_timeout):
                mode = handshake(entry.command)
                async with Client(_transport(entry, errlog), cache=None, mode=mode) as client:
                    return Listing(entry, await _tools(client))
        except TimeoutError:
            why = f"no answer within {format_duration(connect_timeout)} (--connect-timeout sets it)"
        except Exception as exc:  # any failure of a third-party server is its own line, not ours
            why = _reason(exc)
        why = "; ".join([why, *dict.fromkeys(logged)])
        errlog.seek(0)
        said = [line.strip() for line in errlog.read().splitlines() if line.strip()]
        why = f"{why}; it said: {said[-1][:300]}" if said else why
        return Listing(entry, [], one_line(why))  # a server's own words, never a terminal's escape codes


async def _tools(client: Client) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(100):  # a paginator that never ends cannot hang init
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


@contextlib.asynccontextmanager
async def _transport(entry: ServerEntry, errlog: TextIO) -> AsyncIterator[tuple[Any, Any]]:
    async with AsyncExitStack() as stack:
        if entry.command is not None:
            params = StdioServerParameters(
                command=entry.resolved(entry.command),
                args=[entry.resolved(arg) for arg in entry.args],
                env={k: entry.resolved(v) for k, v in entry.env.items()} or None,
                cwd=entry.resolved(entry.cwd) if entry.cwd is not None else None,
            )
            streams = await stack.enter_async_context(stdio_client(params, errlog=errlog))
        else:
            assert entry.url is not None
            url = entry.resolved(entry.url)
            headers = {k: entry.resolved(v) for k, v in entry.headers.items()}
            if entry.transport == "sse":
                streams = await stack.enter_async_context(sse_client(url, headers=headers or None))
            else:
                http = await stack.enter_async_context(httpx2.AsyncClient(headers=headers))
                streams = await stack.enter_async_context(streamable_http_client(url, http_client=http))
        yield streams[0], streams[1]


def _reason(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    said = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__
