"""A lean stdio transport for commitgate's MCP server (the default on POSIX).

The SDK's stdio server reads every line in a worker thread and writes and
flushes every message in worker threads: three thread hops per request. Here
the event loop reads and writes the pipes itself (asyncio pipe transports).
Everything above the framing is the SDK's own: the same message streams feed
the same `Server.run`, so both protocol eras, errors and notifications behave
as with the SDK transport (tests/test_fast_stdio.py holds the same
conversations against both and compares them).

Framing follows the SDK: one JSON-RPC message per line, UTF-8 with invalid
bytes replaced, and fd 0/1 are claimed while serving (fd 0 reads /dev/null, fd 1
writes to stderr) so a stray print() in a tool cannot corrupt the protocol. One difference: a
line that is not a JSON-RPC message is answered with JSON-RPC's error
(-32700 or -32600) and logged, where the SDK's transport drops it silently.
When stdin or stdout is not a pipe or a socket (a file, a terminal), or on
Windows (whose event loop cannot read anonymous pipes), it falls back to the
SDK transport; `commitgate serve --stdio sdk` asks for the SDK's outright.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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

log = logging.getLogger("commitgate.stdio")

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
    group.start_soon(_pump_in, reader, read_send, writer)
    group.start_soon(_pump_out, writer, write_receive)


async def _pump_in(
    reader: asyncio.StreamReader,
    out: ContextSendStream[SessionMessage | Exception],
    writer: asyncio.StreamWriter,
) -> None:
    """Lines from the pipe to the server, one message each, until end of input.

    A line that is not a JSON-RPC message is answered here (-32700 / -32600, as JSON-RPC asks)
    and logged: the server would drop it silently and the client wait forever. Partial lines
    are kept as a list of chunks, joined once: re-joining a growing buffer per chunk made a
    40 MB line cost seconds.
    """
    async with out:
        pending: list[bytes] = []
        while chunk := await reader.read(_CHUNK):
            if b"\n" not in chunk:
                pending.append(chunk)
                continue
            first, *lines, last = chunk.split(b"\n")
            lines.insert(0, b"".join([*pending, first]) if pending else first)
            pending = [last] if last else []
            for line in lines:
                await _deliver(line, out, writer)
        if pending:  # a last line without its newline still counts, as with the SDK
            await _deliver(b"".join(pending), out, writer)


async def _deliver(
    line: bytes, out: ContextSendStream[SessionMessage | Exception], writer: asyncio.StreamWriter
) -> None:
    parsed = _parse(line)
    if isinstance(parsed, SessionMessage):
        await out.send(parsed)
    elif line.strip():  # a blank line is no message at all: nothing to answer
        writer.write(_error_reply(line, parsed) + b"\n")
        await writer.drain()


def _parse(line: bytes) -> SessionMessage | Exception:
    try:
        text = line.decode("utf-8", errors="replace")
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(text, by_name=False))
    except Exception as exc:  # answered by _deliver; the connection lives on
        return exc


def _error_reply(line: bytes, problem: Exception) -> bytes:
    """The JSON-RPC error for a line that is not a message: -32700 if not JSON, else -32600."""
    try:
        document = json.loads(line)
    except ValueError:
        code, message, request_id = types.PARSE_ERROR, "Parse error: the line is not JSON", None
    else:
        code, message = types.INVALID_REQUEST, "Invalid request: not a JSON-RPC 2.0 message"
        candidate = document.get("id") if isinstance(document, dict) else None
        request_id = (
            candidate if isinstance(candidate, str | int) and not isinstance(candidate, bool) else None
        )
    log.warning(
        "answered a malformed stdio line with JSON-RPC error %d (%d bytes, %s)",
        code,
        len(line),
        type(problem).__name__,
    )
    reply = {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}
    return json.dumps(reply, separators=(",", ":")).encode()


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
