"""A lean path for `tools/call` over streamable HTTP, in front of the MCP SDK's session manager.

The SDK serves each HTTP request through Starlette, its session manager, memory streams, its
server's dispatch and an SSE writer; for a guarded no-op that machinery cost more CPU than the
guard. Here a POST holding one `tools/call` that needs nothing from the response stream is
answered directly: the same checks the SDK makes (Host/Origin and Content-Type, Accept, the
2026-07-28 envelope and its headers, `Mcp-Param-*` against the tool's schema, the request's
surface validation), then the same handler chain as every other transport (`calls.py` around
the gateway: limits, logs, metrics, principal, era, request meta), then the result shaped as
the SDK shapes it (per-era sieve, `resultType`, the `serverInfo` stamp), as `application/json`.

Served here: the 2026-07-28 era (each POST self-contained), and handshake-era POSTs on a
`--stateless` server (each POST its own born-ready connection). Everything else goes to the
SDK untouched, the body replayed as it came: initialize, tools/list, notifications, GET and
DELETE, batches, bad JSON, anything a check refuses (the SDK then answers with its own error),
stateful handshake-era sessions (their state lives in the SDK's session task), and calls that
may need server→client messages while they run: a progress token, an approval the client's
user could be asked for, an upstream MCP tool (it relays questions, logs and progress), or
a second round of an earlier answer (`requestState`, `inputResponses`). With tracing on,
every call takes the SDK path too: the SDK opens the `tools/call` span.

Cancellation is the client closing the response, as on the SDK's path: the handler is
cancelled (a keyed operation runs on to its recorded outcome in the commit boundary's own
task). A call silent for longer than the SDK's ping interval commits to `text/event-stream`
and keeps the connection alive with comments, as the SDK does, when the client accepts SSE.

`COMMITGATE_HTTP_SDK_CALLS=1` switches the lean path off (tests compare both paths with it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import mcp.types as types
from mcp import MCPError
from mcp.server import Server
from mcp.server.request_state import RequestStateBoundary
from mcp.server.runner import modern_error_data
from mcp.server.streamable_http import check_accept_headers
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp.shared.inbound import (
    ERROR_CODE_HTTP_STATUS,
    MCP_PARAM_HEADER_PREFIX,
    MCP_PROTOCOL_VERSION_HEADER,
    X_MCP_HEADER_KEY,
    InboundLadderRejection,
    classify_inbound_request,
    find_duplicated_routing_header,
    validate_mcp_param_headers,
)
from mcp_types import (
    DEFAULT_NEGOTIATED_VERSION,
    INTERNAL_ERROR,
    PROTOCOL_VERSION_META_KEY,
    SERVER_INFO_META_KEY,
    methods,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from commitgate.server.serve.asking import ClientChannel
from commitgate.server.serve.auth import principal_of_request
from commitgate.server.serve.calls import Handler
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.meta_tools import META_TOOLS
from commitgate.server.serve.passthrough import has_upstreams
from commitgate.server.serve.reload import ToolListAnnouncer

log = logging.getLogger("commitgate.http_calls")

OFF_ENV = "COMMITGATE_HTTP_SDK_CALLS"
PING_INTERVAL = 15.0  # as the SDK's 2026-07-28 entry: a silent call commits to SSE and pings
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]
# Declared by a client that can be asked something mid-call: its calls take the SDK's path.
_ASKABLE = ("elicitation", "sampling", "roots")
_PARAM_PREFIX = MCP_PARAM_HEADER_PREFIX.lower()
_VERDICTS_KEPT = 256  # distinct header sets whose check is remembered (a client sends one)


@dataclass(frozen=True, slots=True)
class _Lean:
    """One tools/call this path answers: what the SDK would have handed the handler."""

    request_id: types.RequestId
    version: str
    params: types.CallToolRequestParams


class LeanCalls:
    """ASGI middleware: answers plain tools/call POSTs on the MCP path; the rest goes to `app`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        server: Server[Any],
        gateway: Gateway,
        calls: Handler | None,
        path: str,
        settings: TransportSecuritySettings,
        max_body: int,
        stateless: bool,
    ) -> None:
        self.app = app
        self.server, self.gateway, self.calls = server, gateway, calls
        self.path, self.max_body, self.stateless = path, max_body, stateless
        self.security = TransportSecurityMiddleware(settings)
        self._verdicts: dict[tuple[str | None, ...], bool] = {}  # see _admitted
        self._declared: dict[int, tuple[Mapping[str, Any], bool]] = {}  # see _declares_param_headers
        self._silences = _Silences()
        # The server's identity is fixed at construction, and an answer is encoded as soon as it is
        # shaped (nothing edits it on the way): one stamp serves every answer, not a deep copy each.
        self._stamp = server.server_info_stamp
        plain = all(_idle_for_lean_calls(m) for m in server.middleware)
        switched_off = os.environ.get(OFF_ENV) == "1"
        self.on = calls is not None and plain and "tools/call" not in server.cache_hints and not switched_off

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._candidate(scope):
            await self.app(scope, receive, send)
            return
        body, early = await _read_body(receive)
        lean = None if early is not None else await self._screen(scope, Headers(scope=scope), body)
        if lean is None:
            await self.app(scope, _replay(body, early, receive), send)
            return
        await self._serve(lean, receive, send)

    def _candidate(self, scope: Scope) -> bool:
        """A POST to the MCP path of an era served here, with a body small enough to read whole."""
        if not self.on or scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            return False
        headers = Headers(scope=scope)
        version = headers.get(MCP_PROTOCOL_VERSION_HEADER)
        handshake = version is None or version in HANDSHAKE_PROTOCOL_VERSIONS
        if handshake and not self.stateless:
            return False  # a stateful session: its state lives in the SDK's session task
        length = headers.get("content-length")
        return length is not None and length.isdigit() and int(length) <= self.max_body

    # --- the checks: any refusal is left to the SDK, which answers it with its own error -----------

    async def _screen(self, scope: Scope, headers: Headers, body: bytes) -> _Lean | None:
        if not await self._admitted(scope, headers):
            return None
        try:
            decoded = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not _one_call(decoded):
            return None
        params: dict[str, Any] = decoded["params"]
        version = self._version(headers, decoded)
        if version is None or not await self._passes_param_headers(headers, params):
            return None
        try:
            methods.validate_client_request("tools/call", version, params)
            typed = types.CallToolRequestParams.model_validate(params, by_name=False)
        except (KeyError, ValueError, ValidationError):
            return None
        if not self._needs_no_stream(typed):
            return None
        return _Lean(decoded["id"], version, typed)

    async def _admitted(self, scope: Scope, headers: Headers) -> bool:
        """Host/Origin, Content-Type and Accept pass the SDK's checks of a POST.

        The verdict depends on those four headers alone, which a client sends the same on every
        call: it is kept per set of values, so the checks run once per client, not once per call."""
        seen = (
            headers.get("content-type"),
            headers.get("host"),
            headers.get("origin"),
            headers.get("accept"),
        )
        verdict = self._verdicts.get(seen)
        if verdict is None:
            request = Request(scope)
            has_json, has_sse = check_accept_headers(request)
            # Both, as the SDK asks of a POST in either era (not JSON-only mode).
            verdict = (
                has_json and has_sse and await self.security.validate_request(request, is_post=True) is None
            )
            if len(self._verdicts) >= _VERDICTS_KEPT:
                self._verdicts.clear()
            self._verdicts[seen] = verdict
        return verdict

    def _version(self, headers: Headers, decoded: dict[str, Any]) -> str | None:
        """The request's protocol version as the SDK settles it; None where it refuses or asks more."""
        header = headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if header is not None and header not in HANDSHAKE_PROTOCOL_VERSIONS:
            if find_duplicated_routing_header(headers.items()) is not None:
                return None
            route = classify_inbound_request(decoded, headers=dict(headers))
            if isinstance(route, InboundLadderRejection) or _askable(route.client_capabilities):
                return None
            return route.protocol_version
        if "_meta" in decoded["params"] and _has_envelope(decoded["params"]["_meta"]):
            return None  # a 2026-07-28 envelope on a handshake-era request: the SDK decides
        if not _json_content(headers.get("content-type", "")):
            return None  # the handshake-era transport's own check, stricter than the Host/Origin one
        return header if header is not None else DEFAULT_NEGOTIATED_VERSION

    async def _passes_param_headers(self, headers: Headers, params: dict[str, Any]) -> bool:
        """`Mcp-Param-*` headers agree with the arguments, as the SDK checks before dispatch."""
        arguments = params.get("arguments") or {}
        if not arguments and not any(name.startswith(_PARAM_PREFIX) for name in headers):
            return True
        lookup = self.server.get_tool_input_schema
        schema = lookup(params["name"]) if lookup is not None else None
        if schema is None or not self._declares_param_headers(schema):
            return True  # no argument is mirrored in a header: the SDK's check finds nothing to compare
        return validate_mcp_param_headers(schema, arguments, headers) is None

    def _declares_param_headers(self, schema: Mapping[str, Any]) -> bool:
        """`x-mcp-header` appears somewhere in `schema` (known once per schema, not walked per call)."""
        kept = self._declared.get(id(schema))
        if kept is None or kept[0] is not schema:  # the schema itself is kept, so its id is not reused
            if len(self._declared) >= _VERDICTS_KEPT:
                self._declared.clear()
            kept = (schema, f'"{X_MCP_HEADER_KEY}"' in json.dumps(schema))
            self._declared[id(schema)] = kept
        return kept[1]

    def _needs_no_stream(self, params: types.CallToolRequestParams) -> bool:
        """Served by a tool that says nothing to the client while it runs, asked nothing of it."""
        meta = params.meta or {}
        if "progressToken" in meta or "progress_token" in meta:
            return False
        if params.request_state is not None or params.input_responses:
            return False
        gateway, name = self.gateway, params.name
        if name in META_TOOLS:  # compensation may call an upstream's tool
            return gateway.has_tool(name) and not has_upstreams(gateway)
        served = gateway.served.get(name)
        return served is not None and served.exposed and served.guard.policy.source_kind != "upstream"

    # --- the answer --------------------------------------------------------------------------------

    async def _serve(self, lean: _Lean, receive: Receive, send: Send) -> None:
        """Run the call; the client closing the response cancels it, as on the SDK's path."""
        await answered(self._reply(lean), receive, send, self._silences)

    async def _reply(self, lean: _Lean) -> dict[str, Any]:
        params = lean.params
        log.debug("tools/call %s on the lean path (%s)", params.name, lean.version)
        call = self.gateway.envelope(
            params.name, params.arguments, params.meta, principal_of_request(), ClientChannel()
        )
        try:
            assert self.calls is not None  # else the path is off
            result = await self.calls(call)
            shaped = self._shaped(result, lean.version)
        except Exception as exc:  # as the SDK's entry: its errors by its ladder, nothing internal
            error = modern_error_data(exc)
            return {
                "jsonrpc": "2.0",
                "id": lean.request_id,
                "error": error.model_dump(mode="json", exclude_none=True),
            }
        return {"jsonrpc": "2.0", "id": lean.request_id, "result": shaped}

    def _shaped(self, result: Any, version: str) -> dict[str, Any]:
        """The result's wire form, as the SDK's server shapes a tools/call result for `version`."""
        dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        try:
            dumped = methods.serialize_server_result("tools/call", version, dumped)
        except ValidationError:
            log.exception("a tools/call answer is not a valid result")
            raise MCPError(code=INTERNAL_ERROR, message="Handler returned an invalid result") from None
        if version not in MODERN_PROTOCOL_VERSIONS:
            return dumped
        dumped.setdefault("resultType", "complete")
        meta = dumped.get("_meta")
        if meta is None:
            dumped["_meta"] = {SERVER_INFO_META_KEY: self._stamp}
        elif isinstance(meta, dict) and meta.get(SERVER_INFO_META_KEY) is None:
            dumped["_meta"] = {**meta, SERVER_INFO_META_KEY: self._stamp}
        return dumped


async def answered(
    reply: Coroutine[Any, Any, dict[str, Any]], receive: Receive, send: Send, silences: _Silences
) -> None:
    """Send what `reply` comes to, unless the client leaves first: then the call is cancelled.

    The client leaving cancels this task itself (asyncio's own cancellation, counted by
    `Task.cancelling`), which costs far less than an anyio cancel scope per call. Nothing below
    the handler on this path runs a tool in this task: a guarded tool's work has a task of its
    own in the commit boundary, so the cancellation only stops the wait for its answer."""
    keepalive = _Keepalive(send, silences)
    try:
        keepalive.start(receive)
        try:
            answer = await reply
        finally:
            await keepalive.stop()
    except asyncio.CancelledError:
        if not keepalive.cancelled_alone():
            raise  # cancelled from elsewhere too (the server stopping): that goes on up
        return  # the client left; its call is cancelled and there is no one to answer
    keepalive.cancelled_alone()  # a call that ran on past its cancellation: the count is taken back
    await keepalive.finish(answer)


class _Silences:
    """The lean calls in flight, oldest first, with the time each must start pinging; one loop
    timer, set for the oldest's time, serves them all (a timer per call cost more than this)."""

    def __init__(self) -> None:
        self._due: dict[_Keepalive, float] = {}  # in the order the calls began
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the timer's (an app may outlive a loop)

    def add(self, call: _Keepalive) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + PING_INTERVAL
        self._due[call] = due
        if self._timer is None or self._loop is not loop:
            self._timer, self._loop = loop.call_at(due, self._wake), loop

    def remove(self, call: _Keepalive) -> None:
        self._due.pop(call, None)

    def _wake(self) -> None:
        """Start the pings of every call past its time; sleep until the next one's."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._due:
            call, due = next(iter(self._due.items()))
            if due > now:
                self._timer = loop.call_at(due, self._wake)
                return
            del self._due[call]
            call.start_pings()


class _Keepalive:
    """Beside a running call: notices the client leaving, and past the ping interval commits the
    response to SSE and sends keepalive comments (so a proxy's idle timeout cannot cut it).

    One plain task waits for the client to leave, and `_Silences` starts the pings: a task group
    (and its cancel scopes) and a timer per call cost more CPU than the rest of the transport."""

    def __init__(self, send: Send, silences: _Silences) -> None:
        self.send, self.silences = send, silences
        self.committed = False
        self.failed: BaseException | None = None
        self._call: asyncio.Task[Any] | None = None  # the task answering, while it runs
        self._cancelled = False  # the call was cancelled here (its client left, or a ping failed)
        self._watcher: asyncio.Task[None] | None = None
        self._pinger: asyncio.Task[None] | None = None

    def start(self, receive: Receive) -> None:
        self._call = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        self.silences.add(self)  # every call on this path accepts SSE

    async def stop(self) -> None:
        """The call is over: stop watching and pinging (a ping being sent is sent whole first)."""
        self._call = None  # before any await: a departure noticed from now on cancels nothing
        self.silences.remove(self)
        if self._watcher is not None:
            self._watcher.cancel()
        pinger = self._pinger
        if pinger is not None:
            pinger.cancel()
            await asyncio.wait([pinger])
        if self.failed is not None:
            raise self.failed

    def cancelled_alone(self) -> bool:
        """The call's cancellation was this one's alone (then it is taken back: the task goes on)."""
        task = asyncio.current_task()
        return self._cancelled and task is not None and task.uncancel() == 0

    def start_pings(self) -> None:
        if self._call is not None:
            self._pinger = asyncio.get_running_loop().create_task(self._ping())

    def _cancel_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call, self._cancelled = None, True

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:  # the connection broke under us: as good as gone
            self.failed = exc
        self.silences.remove(self)
        if self._pinger is not None:
            self._pinger.cancel()
        self._cancel_call()  # the client is gone: so is its call

    async def _ping(self) -> None:
        self.committed = True  # before the send: once begun, the answer must follow as an event
        try:
            await self.send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            while True:
                await self.send({"type": "http.response.body", "body": b": ping\r\n\r\n", "more_body": True})
                await asyncio.sleep(PING_INTERVAL)
        except Exception as exc:
            self.failed = exc
            self._cancel_call()

    async def finish(self, reply: dict[str, Any]) -> None:
        data = json.dumps(reply, separators=(",", ":"))
        if self.committed:
            frame = f"event: message\r\ndata: {data}\r\n\r\n".encode()
            await self.send({"type": "http.response.body", "body": frame, "more_body": False})
            return
        error = reply.get("error")
        status = ERROR_CODE_HTTP_STATUS.get(error["code"], 200) if error else 200
        body = data.encode()
        headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


# --- reading the request -------------------------------------------------------------------------


async def _read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The whole body; or what came of it, and the message that cut it short (a disconnect)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _replay(body: bytes, early: Message | None, receive: Receive) -> Receive:
    """`receive` for the SDK: the body already read, then whatever comes next."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": early is not None}]
    if early is not None:
        pending.append(early)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def _one_call(decoded: Any) -> bool:
    """One JSON-RPC request (not a batch) calling a tool by name, with an id the SDK accepts."""
    if (
        not isinstance(decoded, dict)
        or decoded.get("jsonrpc") != "2.0"
        or decoded.get("method") != "tools/call"
    ):
        return False
    request_id, params = decoded.get("id"), decoded.get("params")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int):
        return False
    return isinstance(params, dict) and isinstance(params.get("name"), str)


def _idle_for_lean_calls(middleware: Any) -> bool:
    """Server middleware known to do nothing for the calls served here: the request-state boundary
    acts on `requestState` and input-required results, and the tool-list announcer remembers
    handshake-era sessions (stateful ones take the SDK's path). Any other (the SDK's tracing span
    among them) turns the lean path off."""
    return isinstance(middleware, RequestStateBoundary) or isinstance(
        getattr(middleware, "__self__", None), ToolListAnnouncer
    )


def _json_content(content_type: str) -> bool:
    return any(part.strip() == "application/json" for part in content_type.split(";")[0].split(","))


def _has_envelope(meta: Any) -> bool:
    return isinstance(meta, Mapping) and PROTOCOL_VERSION_META_KEY in meta


def _askable(capabilities: Any) -> bool:
    """The client declared something it could be asked mid-call (or said it in a shape we do not read)."""
    if not isinstance(capabilities, Mapping):
        return True
    return any(capabilities.get(name) is not None for name in _ASKABLE)
