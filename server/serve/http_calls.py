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

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
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


@dataclass(frozen=True, slots=True)
class _Lean:
    """One tools/call this path answers: what the SDK would have handed the handler."""

    request_id: types.RequestId
    version: str
    params: types.CallToolRequestParams
    sse_ok: bool


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
        plain = all(_idle_for_lean_calls(m) for m in server.middleware)
        switched_off = os.environ.get(OFF_ENV) == "1"
        self.on = calls is not None and plain and "tools/call" not in server.cache_hints and not switched_off

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._candidate(scope):
            await self.app(scope, receive, send)
            return
        body, early = await _read_body(receive)
        lean = None if early is not None else await self._screen(scope, body)
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

    async def _screen(self, scope: Scope, body: bytes) -> _Lean | None:
        request = Request(scope)
        if await self.security.validate_request(request, is_post=True) is not None:
            return None
        has_json, has_sse = check_accept_headers(request)
        if not (has_json and has_sse):  # what the SDK asks of a POST in either era (not JSON-only mode)
            return None
        try:
            decoded = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not _one_call(decoded):
            return None
        params: dict[str, Any] = decoded["params"]
        version = self._version(request, decoded)
        if version is None or not await self._passes_param_headers(request, params):
            return None
        try:
            methods.validate_client_request("tools/call", version, params)
            typed = types.CallToolRequestParams.model_validate(params, by_name=False)
        except (KeyError, ValueError, ValidationError):
            return None
        if not self._needs_no_stream(typed):
            return None
        return _Lean(decoded["id"], version, typed, has_sse)

    def _version(self, request: Request, decoded: dict[str, Any]) -> str | None:
        """The request's protocol version as the SDK settles it; None where it refuses or asks more."""
        header = request.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if header is not None and header not in HANDSHAKE_PROTOCOL_VERSIONS:
            if find_duplicated_routing_header(request.headers.items()) is not None:
                return None
            route = classify_inbound_request(decoded, headers=dict(request.headers))
            if isinstance(route, InboundLadderRejection) or _askable(route.client_capabilities):
                return None
            return route.protocol_version
        if "_meta" in decoded["params"] and _has_envelope(decoded["params"]["_meta"]):
            return None  # a 2026-07-28 envelope on a handshake-era request: the SDK decides
        if not _json_content(request.headers.get("content-type", "")):
            return None  # the handshake-era transport's own check, stricter than the Host/Origin one
        return header if header is not None else DEFAULT_NEGOTIATED_VERSION

    async def _passes_param_headers(self, request: Request, params: dict[str, Any]) -> bool:
        """`Mcp-Param-*` headers agree with the arguments, as the SDK checks before dispatch."""
        arguments = params.get("arguments") or {}
        if not arguments and not any(name.startswith(_PARAM_PREFIX) for name in request.headers):
            return True
        lookup = self.server.get_tool_input_schema
        schema = lookup(params["name"]) if lookup is not None else None
        return schema is None or validate_mcp_param_headers(schema, arguments, request.headers) is None

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
        reply: list[dict[str, Any]] = []
        streaming = _Keepalive(send, lean.sse_ok)
        async with anyio.create_task_group() as group:
            group.start_soon(streaming.run, receive, group.cancel_scope)
            reply.append(await self._reply(lean))
            group.cancel_scope.cancel()
        if reply:
            await streaming.finish(reply[0])

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
            dumped["_meta"] = {SERVER_INFO_META_KEY: self.server.server_info_stamp}
        elif isinstance(meta, dict) and meta.get(SERVER_INFO_META_KEY) is None:
            dumped["_meta"] = {**meta, SERVER_INFO_META_KEY: self.server.server_info_stamp}
        return dumped


class _Keepalive:
    """Beside a running call: notices the client leaving, and past the ping interval commits the
    response to SSE and sends keepalive comments (so a proxy's idle timeout cannot cut it)."""

    def __init__(self, send: Send, sse_ok: bool) -> None:
        self.send, self.sse_ok = send, sse_ok
        self.committed = False

    async def run(self, receive: Receive, scope: anyio.CancelScope) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self._ping)
            while (await receive())["type"] != "http.disconnect":
                pass
        scope.cancel()  # the client is gone: so is its call

    async def _ping(self) -> None:
        if not self.sse_ok:
            return
        await anyio.sleep(PING_INTERVAL)
        self.committed = True  # before the send: once begun, the answer must follow as an event
        await self.send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        while True:
            await self.send({"type": "http.response.body", "body": b": ping\r\n\r\n", "more_body": True})
            await anyio.sleep(PING_INTERVAL)

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
