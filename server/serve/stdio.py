"""A lean stdio transport for commitgate's MCP server (the default on POSIX).

The SDK's stdio server reads every line in a worker thread and writes and
flushes every message in worker threads: three thread hops per request. Here
the event loop reads and writes the pipes itself (asyncio pipe transports).
Everything above the framing is the SDK's own: the same message streams feed
the same `Server.run`, so both protocol eras, errors and notifications behave
as with the SDK transport (tests/test_fast_stdio.py holds the same
conversations against both and compares them).

Framing follows the SDK: one JSON-RPC message per line, UTF-8 with invalid
bytes replaced, a line that does not parse is handed to the server as an
exception, and fd 0/1 are claimed while serving (fd 0 reads /dev/null, fd 1
writes to stderr) so a stray print() in a tool cannot corrupt the protocol.
When stdin or stdout is not a pipe or a socket (a file, a terminal), or on
Windows (whose event loop cannot read anonymous pipes), it falls back to the
SDK transport; `commitgate serve --stdio sdk` asks for the SDK's outright.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import mcp.types as types
from anyio.abc import TaskGroup
from mcp.shared._context_streams import ContextReceiveStream, ContextSendStream, create_context_streams
from mcp.shared.message import SessionMessage

_CHUNK = 1 << 16

ReadStreams = tuple[ContextReceiveStream[SessionMessage | Exception], ContextSendStream[SessionMessage]]


def _is_pipe_or_socket(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextlib.asynccontextmanager
async def fast_stdio_server() -> AsyncIterator[ReadStreams]:
    """Serve MCP over the process's stdin/stdout from the event loop; same streams as the SDK's."""
    if os.name != "posix" or not (_is_pipe_or_socket(0) and _is_pipe_or_socket(1)):
        from mcp.server.stdio import stdio_server as sdk_stdio_server

        async with sdk_stdio_server() as streams:
            yield streams
        return
    with _claimed_std_fds() as (wire_in, wire_out):
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_CHUNK * 4)
        read_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(wire_in, "rb", buffering=0)
        )
        write_transport, write_protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(wire_out, "wb", buffering=0)
        )
        writer = asyncio.StreamWriter(write_transport, write_protocol, None, loop)
        read_send, read_receive = create_context_streams[SessionMessage | Exception](0)
        write_send, write_receive = create_context_streams[SessionMessage](0)
        try:
            async with anyio.create_task_group() as group:
                _start(group, reader, read_send, writer, write_receive)
                yield read_receive, write_send
        finally:
            read_transport.close()
            write_transport.close()


def _start(
    group: TaskGroup,
    reader: asyncio.StreamReader,
    read_send: ContextSendStream[SessionMessage | Exception],
    writer: asyncio.StreamWriter,
    write_receive: ContextReceiveStream[SessionMessage],
) -> None:
    group.start_soon(_pump_in, reader, read_send)
    group.start_soon(_pump_out, writer, write_receive)


async def _pump_in(reader: asyncio.StreamReader, out: ContextSendStream[SessionMessage | Exception]) -> None:
    """Lines from the pipe to the server, one message (or parse error) each, until end of input."""
    async with out:
        pending = b""
        while chunk := await reader.read(_CHUNK):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                await out.send(_parse(line))
        if pending:  # a last line without its newline still counts, as with the SDK
            await out.send(_parse(pending))


def _parse(line: bytes) -> SessionMessage | Exception:
    try:
        text = line.decode("utf-8", errors="replace")
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(text, by_name=False))
    except Exception as exc:  # the server answers a malformed line; the connection lives on
        return exc


async def _pump_out(writer: asyncio.StreamWriter, source: ContextReceiveStream[SessionMessage]) -> None:
    async with source:
        async for message in source:
            text = message.message.model_dump_json(by_alias=True, exclude_unset=True)
            writer.write(text.encode("utf-8") + b"\n")
            await writer.drain()  # back-pressure from a slow reader, and an error if it went away


@contextlib.contextmanager
def _claimed_std_fds() -> Any:
    """The wire on private descriptors; fd 0 reads /dev/null and fd 1 goes to stderr meanwhile."""
    sys.stdout.flush()
    saved_in, saved_out = os.dup(0), os.dup(1)
    wire_in, wire_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
        os.dup2(2, 1)
        yield wire_in, wire_out
    finally:
        os.close(null)
        sys.stdout.flush()
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        os.close(saved_in)
        os.close(saved_out)
