"""The HTTP transports: streamable HTTP (`/mcp`) and SSE (`/sse` + `/messages/`), with bearer auth.

Both MCP protocol eras are served at once (the SDK routes each request). Next
to MCP: `/healthz` (process up and ledger writable; no auth, for probes) and
`/metrics` (Prometheus text; needs an operator's token when `[auth]` has tokens;
an agent's token is refused there, and an operator's token on MCP).

Safety rules enforced here, before anything listens:
- a non-loopback bind needs `[auth]` tokens (ServeRefused says why otherwise);
- loopback binds check Host/Origin headers (DNS-rebinding protection), also
  on `/healthz` and `/metrics`;
- request bodies are capped (HTTP 413) above what the argument limit needs.

Per call, the wrappers of calls.py (as on stdio); the metrics observe the gateway's
events, so each answered `tools/call` is one sample on `/metrics`.
On streamable HTTP a plain `tools/call` skips the SDK's transport machinery
(http_calls.py); everything else is the SDK's.

Shutdown (SIGTERM or SIGINT): uvicorn stops accepting and closes streams; the
work of every operation already claimed runs in tasks owned by the commit
boundary, not by requests, so `boundary.running()` then drains it and each
records its outcome in the ledger before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import h11
import uvicorn
from mcp.server import Server
from mcp.server.auth.middleware.bearer_auth import RequireAuthMiddleware
from mcp.server.sse import SseServerTransport
from mcp.server.transport_security import (
    DEFAULT_MAX_REQUEST_BODY_SIZE,
    TransportSecurityMiddleware,
    TransportSecuritySettings,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, request_response
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from commitgate.server.serve.auth import (
    AuthConfigError,
    PolicyTokenVerifier,
    install_auth,
    metadata_routes,
)
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.http_calls import LeanCalls
from commitgate.server.serve.logs import extra
from commitgate.server.serve.metrics import CONTENT_TYPE, Metrics
from commitgate.server.serve.reload import ToolListAnnouncer
from commitgate.server.serve.surface import build_server, initialization_options, serving

log = logging.getLogger("commitgate.transports")

TRANSPORTS = ("sse", "streamable-http")
MCP_PATH, SSE_PATH, MESSAGES_PATH = "/mcp", "/sse", "/messages/"
BODY_MARGIN = 64 * 1024  # JSON-RPC envelope and _meta around the arguments
HEALTH_TIMEOUT = 5.0
# With a port, and without one (a client on port 80 sends `Host: 127.0.0.1`).
LOOPBACK_HOSTS = ("127.0.0.1:*", "localhost:*", "[::1]:*", "127.0.0.1", "localhost", "[::1]")
HEADER_TIMEOUT = 10  # seconds a connection may take to send a request's headers
BODY_TIMEOUT = 30  # seconds a request's body may take once its headers are in (1 MiB at 35 KiB/s)
# Seconds an idle connection is kept open: longer than clients keep theirs (httpx 5 s, Node 4 s) and
# than load balancers' idle timeouts (60 s), so the client closes it first. A server closing at the
# same moment as the client reuses the connection fails that call with a transport error, and the
# MCP SDK then ends the whole session (docs/operating.md#http-transports-principals-and-auth).
IDLE_KEEP_ALIVE = 65


class ServeRefused(SystemExit):
    """The server will not start as asked; the message (printed on exit, status 1) says why."""

    def __init__(self, message: str) -> None:
        super().__init__(f"commitgate: {message}")


# --- start-up checks -------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def token_verifier(gateway: Gateway, environ: Mapping[str, str] | None = None) -> PolicyTokenVerifier | None:
    """The verifier for the policy's `[[auth.tokens]]`, or None when there are none."""
    try:
        verifier = PolicyTokenVerifier(lambda: gateway.policy.auth, environ)
    except AuthConfigError as exc:
        raise ServeRefused(str(exc)) from None
    return verifier if verifier else None


def check_bind(host: str, authenticated: bool, verifier: PolicyTokenVerifier | None = None) -> None:
    oauth = verifier.oauth.policy if verifier is not None and verifier.oauth is not None else None
    if oauth is not None and oauth.resource is None and not is_loopback(host):
        raise ServeRefused(
            f"[auth.oauth] needs `resource` to listen on {host!r}: the public URL of this server's /mcp"
            ' (e.g. resource = "https://mcp.example.com/mcp"), which clients ask tokens for and tokens'
            " must name as their audience"
        )
    if authenticated or is_loopback(host):
        return
    raise ServeRefused(
        f"refusing to listen on {host!r} without authentication: anyone who can reach that address could "
        "act with this server's tools. Add [[auth.tokens]] to the policy (principal + token_env or "
        "token_sha256), or bind a loopback address such as 127.0.0.1."
    )


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before anything is announced; ServeRefused says why it cannot be."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, OverflowError) as exc:
        raise ServeRefused(f"cannot listen on {host!r} port {port}: {_reason(exc)}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except (OSError, OverflowError) as exc:
        sock.close()
        hint = "; pick another with --port" if getattr(exc, "errno", None) == errno.EADDRINUSE else ""
        raise ServeRefused(f"cannot listen on {host}:{port}: {_reason(exc)}{hint}") from None
    return sock


def _reason(exc: BaseException) -> str:
    return (getattr(exc, "strerror", None) or str(exc)).rstrip(".")


def served_url(transport: str, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}{MCP_PATH if transport == 'streamable-http' else SSE_PATH}"


def security_settings(host: str, allowed_hosts: Sequence[str] = ()) -> TransportSecuritySettings:
    """Host/Origin checks: always on loopback binds; elsewhere only for the hosts the operator names."""
    hosts = [h.lower() for h in allowed_hosts]  # compared with lower-cased headers (_HostCase)
    if is_loopback(host):
        hosts += LOOPBACK_HOSTS
    if not hosts:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    origins = [f"{scheme}://{h}" for h in hosts for scheme in ("http", "https")]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins
    )


class _HostCase:
    """ASGI middleware: Host and Origin in lower case before the DNS-rebinding check compares them.

    Host names are case-insensitive; the SDK's check compares strings, so `Host: LOCALHOST:8765`
    was refused on a loopback bind.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and _cased(scope.get("headers", [])):
            headers = [(name, value.lower() if name in _CASED else value) for name, value in scope["headers"]]
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


_CASED = (b"host", b"origin")


def _cased(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """A Host or Origin with an upper-case letter (clients nearly always send them lower case:
    the scope is then passed on as it is, not copied on every request)."""
    return any(name in _CASED and value != value.lower() for name, value in headers)


class _HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a request's headers within
    HEADER_TIMEOUT seconds, or its body within BODY_TIMEOUT seconds after them. Without it a client
    sending half a header, or a body a byte at a time, held the connection (and its memory) for
    ever: uvicorn's keep-alive timer runs only between requests."""

    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are complete
            self._disarm()
        self._watch_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._body_done()
        super().connection_lost(exc)

    def _watch_body(self) -> None:
        """A total bound, not an idle one: a byte now and then must not keep a body coming for ever."""
        if self.conn.their_state is not h11.SEND_BODY:
            self._body_done()
        elif self._body_timer is None:
            self._body_timer = self.loop.call_later(BODY_TIMEOUT, self._body_overdue)

    def _body_done(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_overdue(self) -> None:
        self._body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT, self._headers_overdue)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def max_body_bytes(gateway: Gateway) -> int:
    return max(DEFAULT_MAX_REQUEST_BODY_SIZE, gateway.policy.server.limits.max_argument_bytes + BODY_MARGIN)


# --- the ASGI app --------------------------------------------------------------------------------


class _App:
    """An ASGI app as an object: Starlette's Route takes a plain function for a request handler."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def protect(app: ASGIApp, authenticated: bool) -> ASGIApp:
    """With tokens configured, 401 unless the request carried a valid one."""
    return RequireAuthMiddleware(app, []) if authenticated else _App(app)


def ops_routes(
    gateway: Gateway, metrics: Metrics, settings: TransportSecuritySettings, authenticated: bool
) -> list[Route]:
    guard = TransportSecurityMiddleware(settings)

    async def healthz(request: Request) -> Response:
        refusal = await guard.validate_request(request)
        if refusal is not None:
            return refusal
        try:
            await asyncio.wait_for(gateway.ledger.check_writable(), HEALTH_TIMEOUT)
        except Exception:
            return JSONResponse({"status": "unavailable", "ledger": "not writable"}, status_code=503)
        return JSONResponse({"status": "ok", "ledger": "writable"})

    async def metrics_text(request: Request) -> Response:
        refusal = await guard.validate_request(request)
        if refusal is not None:
            return refusal
        sees = getattr(request.state, "sees", None)  # set by the bearer backend for a known token
        return Response(
            await metrics.exposition(gateway.ledger, gateway.policy.budgets, sees), media_type=CONTENT_TYPE
        )

    metrics_app = protect(request_response(metrics_text), authenticated)
    return [Route("/healthz", healthz, methods=["GET"]), Route("/metrics", metrics_app, methods=["GET"])]


def build_app(
    gateway: Gateway,
    transport: str,
    *,
    host: str = "127.0.0.1",
    version: str = "",
    stateless: bool = False,
    allowed_hosts: Sequence[str] = (),
    metrics: Metrics | None = None,
    verifier: PolicyTokenVerifier | None = None,
    announcer: ToolListAnnouncer | None = None,
) -> Starlette:
    if transport not in TRANSPORTS:
        raise ServeRefused(f"unknown HTTP transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
    if stateless and transport != "streamable-http":
        raise ServeRefused(
            "--stateless applies to --transport streamable-http only (SSE keeps a stream open)"
        )
    metrics = metrics or Metrics()
    metrics.attach(gateway)
    settings = security_settings(host, allowed_hosts)
    server = build_server(gateway, version, announcer=announcer)
    routes = ops_routes(gateway, metrics, settings, verifier is not None)
    resource_path = MCP_PATH if transport == "streamable-http" else SSE_PATH
    if verifier is not None and verifier.oauth is not None:
        routes += metadata_routes(verifier.oauth.policy, resource_path)
    if transport == "streamable-http":
        app = server.streamable_http_app(
            streamable_http_path=MCP_PATH,
            stateless_http=stateless,
            max_request_body_size=max_body_bytes(gateway),
            transport_security=settings,
            host=host,
            custom_starlette_routes=routes,  # tokens are checked by our own middleware (install_auth)
        )
        # Added first, so it runs innermost: after the token and Host checks of the middleware below.
        app.add_middleware(
            LeanCalls,
            server=server,
            gateway=gateway,
            calls=server.answer_call,
            path=MCP_PATH,
            settings=settings,
            max_body=max_body_bytes(gateway),
            stateless=stateless,
        )
    else:
        app = _sse_app(server, settings, max_body_bytes(gateway), routes, verifier)
    if verifier is not None:
        install_auth(app, verifier, resource_path)
    app.add_middleware(_HostCase)  # outermost of ours: every route's Host check sees lower case
    return app


def _sse_app(
    server: Server[Any],
    settings: TransportSecuritySettings,
    max_body: int,
    routes: list[Route],
    verifier: PolicyTokenVerifier | None,
) -> Starlette:
    sse = SseServerTransport(MESSAGES_PATH, security_settings=settings, max_request_body_size=max_body)
    guard = TransportSecurityMiddleware(settings)

    async def handle_sse(scope: Scope, receive: Receive, send: Send) -> None:
        refusal = await guard.validate_request(Request(scope, receive))
        if refusal is not None:  # checked here so connect_sse never has to refuse mid-stream
            await refusal(scope, receive, send)
            return
        async with sse.connect_sse(scope, receive, send) as (read, write):
            await server.run(read, write, initialization_options(server))

    mcp_routes: list[Route | Mount] = [
        Route(SSE_PATH, protect(handle_sse, verifier is not None), methods=["GET"]),
        Mount(MESSAGES_PATH, app=protect(sse.handle_post_message, verifier is not None)),
    ]
    return Starlette(routes=[*routes, *mcp_routes])


# --- serving -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _signals_end_serving() -> Iterator[None]:
    """uvicorn re-raises the signal that stopped it; make that a no-op so the drain still runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in caught}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def serve_http(
    gateway: Gateway,
    transport: str,
    host: str = "127.0.0.1",
    port: int = 8765,
    version: str = "",
    *,
    stateless: bool = False,
    allowed_hosts: Sequence[str] = (),
    metrics: Metrics | None = None,
    shutdown_grace: int = 5,
    environ: Mapping[str, str] | None = None,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM, then let in-flight operations record their outcome.

    `announce` is told the URL once the socket listens (the CLI prints it for the person who started it).
    """
    verifier = token_verifier(gateway, environ)
    check_bind(host, verifier is not None, verifier)
    metrics = metrics or Metrics()
    announcer = ToolListAnnouncer()
    app = build_app(
        gateway,
        transport,
        host=host,
        version=version,
        stateless=stateless,
        allowed_hosts=allowed_hosts,
        metrics=metrics,
        verifier=verifier,
        announcer=announcer,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,  # our JSON handler on the root logger formats uvicorn's records too
        timeout_graceful_shutdown=shutdown_grace,
        server_header=False,
        http=_HeaderTimeoutH11,
        ws="none",  # MCP has no WebSocket transport; uvicorn's default imports `websockets` at start
        timeout_keep_alive=IDLE_KEEP_ALIVE,
    )
    server = uvicorn.Server(config)
    sock = listen(host, port)
    url = served_url(transport, sock)
    log.info(
        "serving", extra=extra(url=url, transport=transport, auth=verifier is not None, stateless=stateless)
    )
    if announce is not None:
        announce(url)
    try:
        async with serving(gateway, announcer):
            with _signals_end_serving():
                await server.serve(sockets=[sock])
            log.info("stopped accepting requests; letting in-flight operations record their outcome")
    finally:
        sock.close()
