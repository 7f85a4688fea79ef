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
writes to stderr) so a stray print() in a tool cannot corrupt the protocol.
Every line is answered (`screen`): one that is not a valid JSON-RPC message
(not JSON, nested too deeply, a number too large to read, an id that is not a
string or an integer) gets JSON-RPC's error (-32700 or -32600) and is logged,
where the SDK's reader drops it silently and the client waits forever.
`commitgate serve --stdio sdk` serves the SDK's transport fed by the same
screening, from a daemon thread that a SIGTERM need not wait for; it is also
the fallback when stdin or stdout is not a pipe or a socket (a file, a
terminal), or on Windows (whose event loop cannot read anonymous pipes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import anyio
import mcp.types as types
from anyio.abc import TaskGroup
from mcp.shared._context_streams import ContextReceiveStream, ContextSendStream, create_context_streams
from mcp.shared.message import SessionMessage

from commitgate.server.ledger.threads import name_os_thread

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
    screened = screen(line)
    if isinstance(screened, SessionMessage):
        await out.send(screened)
    elif screened is not None:
        writer.write(_encoded(screened))
        await writer.drain()


def screen(line: bytes) -> SessionMessage | types.JSONRPCError | None:
    """The message a line holds; else JSON-RPC's error answering it; None for a blank line."""
    try:
        text = line.decode("utf-8", errors="replace")
        message = types.jsonrpc_message_adapter.validate_json(text, by_name=False)
    except Exception as exc:  # answered by the caller; the connection lives on
        return _refusal(line, exc) if line.strip() else None
    if isinstance(message, types.JSONRPCNotification) and b'"id"' in line and _has_id(line):
        # An id that is not a string or an integer: pydantic took it for a notification, which
        # would get no answer at all.
        return _refusal(line, TypeError("id"), "Invalid request: an id must be a string or an integer")
    return SessionMessage(message)


def _has_id(line: bytes) -> bool:
    document = json.loads(line)
    return isinstance(document, dict) and "id" in document


def _refusal(line: bytes, problem: Exception, why: str = "") -> types.JSONRPCError:
    """-32700 if the line is not JSON, else -32600 (with the request's id when it has a usable one)."""
    request_id: types.RequestId | None = None
    try:
        document = json.loads(line)
    except RecursionError:
        code, message = types.INVALID_REQUEST, "Invalid request: nested too deeply to read"
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            code, message = types.PARSE_ERROR, "Parse error: the line is not JSON"
        else:
            code, message = types.INVALID_REQUEST, _TOO_LARGE
            request_id = _usable_id(json.loads(line, parse_int=_int_or_none))
    else:
        code, message = types.INVALID_REQUEST, why or "Invalid request: not a JSON-RPC 2.0 message"
        request_id = _usable_id(document)
    log.warning(
        "answered a malformed stdio line with JSON-RPC error %d (%d bytes, %s)",
        code,
        len(line),
        type(problem).__name__,
    )
    return types.JSONRPCError(jsonrpc="2.0", id=request_id, error=types.ErrorData(code=code, message=message))


_TOO_LARGE = "Invalid request: a number in it is too large to read"


def _int_or_none(digits: str) -> int | None:
    """Python refuses to read integers of more than 4,300 digits (a guard against slow parsing)."""
    try:
        return int(digits)
    except ValueError:
        return None


def _usable_id(document: Any) -> types.RequestId | None:
    candidate = document.get("id") if isinstance(document, dict) else None
    return candidate if isinstance(candidate, str | int) and not isinstance(candidate, bool) else None


async def _pump_out(writer: asyncio.StreamWriter, source: ContextReceiveStream[SessionMessage]) -> None:
    async with source:
        async for message in source:
            writer.write(_encoded(message.message))
            await writer.drain()  # back-pressure from a slow reader, and an error if it went away


def _encoded(message: types.JSONRPCMessage) -> bytes:
    """One line of the wire: the text `model_dump_json` gives, as the UTF-8 bytes pydantic makes
    first (no decode to text and encode back per message), and its newline."""
    return message.__pydantic_serializer__.to_json(message, by_alias=True, exclude_unset=True) + b"\n"


@contextlib.asynccontextmanager
async def sdk_stdio_server() -> AsyncIterator[ReadStreams]:
    """The SDK's stdio transport, fed by a line reader of ours: malformed lines are answered as
    on the lean transport, and the reader is a daemon thread, so SIGTERM never waits for stdin
    to close (the SDK reads in a worker thread that a cancelled serve must wait for)."""
    from mcp.server.stdio import stdio_server

    with _claimed_fd(0, os.open(os.devnull, os.O_RDONLY)) as wire_in:
        lines = _Lines(wire_in)
        async with stdio_server(stdin=cast(Any, lines)) as (read, write):
            lines.answer_on(write)
            yield read, write


class _Lines:
    """stdin's lines for the SDK's reader, from a daemon thread; the malformed ones answered here."""

    def __init__(self, fd: int) -> None:
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)
        self._answers: ContextSendStream[SessionMessage] | None = None
        self._ready = anyio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(fd, loop), daemon=True, name="commitgate-stdin").start()

    def answer_on(self, write: ContextSendStream[SessionMessage]) -> None:
        self._answers = write
        self._ready.set()

    def _read(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        name_os_thread()
        # The thread owns the descriptor: it is closed after the last read, never under a read.
        with os.fdopen(fd, "rb") as wire, contextlib.suppress(RuntimeError):
            for line in iter(wire.readline, b""):
                asyncio.run_coroutine_threadsafe(self._queue.put(line), loop).result()
            asyncio.run_coroutine_threadsafe(self._queue.put(b""), loop).result()

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        while line := await self._queue.get():
            screened = screen(line.rstrip(b"\r\n"))
            if isinstance(screened, SessionMessage):
                return line.decode("utf-8", errors="replace")
            if screened is not None:
                await self._ready.wait()
                assert self._answers is not None
                await self._answers.send(SessionMessage(screened))
        raise StopAsyncIteration


@contextlib.contextmanager
def _claimed_fd(fd: int, stand_in: int) -> Iterator[int]:
    """A private copy of `fd` for the wire while `fd` itself points at `stand_in`; restored after."""
    saved, wire = os.dup(fd), os.dup(fd)
    try:
        os.dup2(stand_in, fd)
        yield wire
    finally:
        os.close(stand_in)
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def _claimed_std_fds() -> Iterator[tuple[int, int]]:
    """The wire on private descriptors; fd 0 reads /dev/null and fd 1 goes to stderr meanwhile."""
    sys.stdout.flush()
    try:
        with (
            _claimed_fd(0, os.open(os.devnull, os.O_RDONLY)) as wire_in,
            _claimed_fd(1, os.dup(2)) as wire_out,
        ):
            yield wire_in, wire_out
    finally:
        sys.stdout.flush()
