"""`upstream = "NAME"`: a tool of another MCP server, proxied through the commit boundary.

    [upstreams.memory]
    command = "npx"                        # stdio; or url = "http://127.0.0.1:9000/mcp" (+ headers)
    args = ["-y", "@modelcontextprotocol/server-memory"]
    env = { MEMORY_FILE_PATH = "/srv/memory.jsonl" }

    [tools.create_entities]
    upstream = "memory"
    upstream_tool = "create_entities"      # default: the policy's tool name
    class = "key-required"

An `UpstreamManager` connects to every upstream the policy uses in the background when the gateway
opens (and keeps reconnecting, with backoff, when one dies): the server answers clients at once and a
call to a tool whose upstream is still connecting waits for it (bounded by the tool's timeout); a
call made while a lost upstream waits out its backoff starts the next attempt at once. It
imports the declared tools' schemas, descriptions, output schemas and annotations, and hands the
registry one `UpstreamTool` source per policy entry. When a connection lists other tools than before
(it was connecting at start, or came back changed), `tools_changed` is set and the server rebuilds
those sources and tells clients (server/reload.py). Tools the policy does not list are never served
(fail closed) unless the upstream says `tools = "all"` (`implied_entries`); `inventory()` lists every
offered tool for `policy show`.

Outcomes of a proxied call:
* the upstream is not connected (nor connected within the tool's timeout while connecting):
  `RetryableError` (the call was certainly not sent);
* the connection dies while the call is in flight, or the call times out: `AmbiguousError`;
* a JSON-RPC rejection (invalid params, unknown method): `PermanentError`;
* an `isError` result of a keyed tool: `PermanentError` with its text, whatever the text says: the
  upstream ran the call, so nothing proves its effect did not happen (it is never retried, and its
  budget spend is kept); of a `safe-retry` tool, `PermanentError` unless the text says it is
  transient (rate limited: `RetryableError`; timed out / temporarily unavailable: `AmbiguousError`).

What an upstream says to the client while serving a call (questions, progress, log messages) is relayed
to that client only, and its change notifications passed on (tools/upstream_relay.py); with
`sessions = "per-client"` each client session's calls go through an upstream session of its own.

Each call carries `_meta = {"commitgate/session": ..., "commitgate/step": <key>}`, and the key as the
`idempotency_key` argument when the upstream tool takes one, so a chain of commitgate servers dedups
end to end. `status_check = {python = ...}` (or `{http = ...}`) works as for other schema tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import time
import typing
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import mcp.types as types
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from commitgate.server.model import traces
from commitgate.server.model.context import OperationContext
from commitgate.server.model.facts import SESSION_META, STEP_META
from commitgate.server.model.outcomes import AmbiguousError, PermanentError, RetryableError
from commitgate.server.model.records import ToolResult
from commitgate.server.policy.models import Policy, ToolPolicy, UpstreamPolicy
from commitgate.server.policy.rules import prefixed_tool_name, usable_tool_name
from commitgate.tools import processes
from commitgate.tools.base import Collaborators, DeclarationError
from commitgate.tools.hints import class_warnings, proposed_class
from commitgate.tools.http import SchemaValidator, StatusCheck, status_check_for
from commitgate.tools.upstream_relay import CALLER, Hub, PerClient, Relay, outside_any_call

log = logging.getLogger("commitgate.tools.upstream")

KEY_ARGUMENT = "idempotency_key"

BACKOFF_INITIAL = 0.2
BACKOFF_MAX = 10.0
STABLE_AFTER = 30.0  # a connection that lived this long resets the backoff
MAX_MESSAGE_CHARS = 2000

_RATE_LIMITED = re.compile(r"rate.?limit|too many requests|\b429\b", re.IGNORECASE)
_TRANSIENT = re.compile(
    r"timed?.?out|timeout|temporar(il)?y|unavailable|try again|ECONNRESET|ETIMEDOUT", re.IGNORECASE
)
_REJECTED = frozenset(
    {types.INVALID_PARAMS, types.METHOD_NOT_FOUND, types.INVALID_REQUEST, types.PARSE_ERROR}
)


# --- one connection --------------------------------------------------------------------------------


class _WatchedStream:
    """The transport's read stream, telling `lost` when it ends (the upstream died or hung up)."""

    def __init__(self, inner: Any, lost: asyncio.Event) -> None:
        self._inner, self._lost = inner, lost

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def __aenter__(self) -> _WatchedStream:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        self._lost.set()
        return await self._inner.__aexit__(*exc)

    def __aiter__(self) -> _WatchedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except (StopAsyncIteration, anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._lost.set()
            raise

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._lost.set()
            raise

    async def aclose(self) -> None:
        self._lost.set()
        await self._inner.aclose()


def inherited_env(spec: UpstreamPolicy) -> dict[str, str] | None:
    """What a stdio upstream gets beside the MCP SDK's safe defaults: the variables of serve's own
    environment that `inherit_env` names (all of them for "*"), then its own `env`."""
    wanted = spec.inherit_env
    inherited = dict(os.environ) if wanted == "*" else {n: os.environ[n] for n in wanted if n in os.environ}
    merged = {**inherited, **spec.env}
    return merged or None


@contextlib.asynccontextmanager
async def _transport(spec: UpstreamPolicy, lost: asyncio.Event) -> AsyncIterator[tuple[Any, Any]]:
    async with AsyncExitStack() as stack:
        if spec.command is not None:
            params = StdioServerParameters(
                command=spec.command, args=spec.args, env=inherited_env(spec), cwd=spec.cwd
            )
            groups: list[int] = []
            stack.callback(processes.end, groups)  # runs last: what outlived the SDK's own stop
            with processes.recording(groups):
                read, write = await stack.enter_async_context(
                    stdio_client(params, errlog=processes.stderr_for_children())
                )
        elif spec.transport == "sse":
            assert spec.url is not None
            read, write = await stack.enter_async_context(sse_client(spec.url, headers=spec.headers or None))
        else:
            assert spec.url is not None
            http = await stack.enter_async_context(
                httpx2.AsyncClient(headers=spec.headers, timeout=httpx2.Timeout(30.0, read=300.0))
            )
            read, write = await stack.enter_async_context(streamable_http_client(spec.url, http_client=http))
        yield _WatchedStream(read, lost), write


def _reason(exc: BaseException) -> str:
    """What went wrong, for logs: the innermost exception's type and message (never the spec)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _list_all(client: Client) -> dict[str, types.Tool]:
    tools: dict[str, types.Tool] = {}
    cursor: str | None = None
    for _ in range(100):  # a paginator that never ends cannot hang the connection
        page = await client.list_tools(cursor=cursor)
        tools.update({tool.name: tool for tool in page.tools})
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def handshake(command: str | None) -> str:
    """The client's connect mode for an upstream: a stdio server built on an older SDK does not know
    the `server/discover` probe and logs a validation error for it, while the `initialize` handshake
    is what every server understands."""
    return "legacy" if command is not None else "auto"


class UpstreamConnection:
    """One upstream server: connect, list its tools, hold the session, reconnect with backoff."""

    def __init__(self, name: str, spec: UpstreamPolicy, connect_timeout: float | None = None) -> None:
        self.name, self.spec = name, spec
        self.connect_timeout = spec.connect_timeout if connect_timeout is None else connect_timeout
        self.tools: dict[str, types.Tool] = {}
        self.listed = False  # the tools were listed at least once
        self.error: str | None = None
        self.connects = 0
        self.on_new_tools: Callable[[], None] | None = None  # the manager's: the offered tools changed
        self.warned: set[str] = set()  # warnings about its tools' classes, said once (not at each rebuild)
        self._client: Client | None = None
        self._lost = asyncio.Event()
        self.connecting = True  # an attempt is under way (or about to start); calls wait for it
        self._settled = asyncio.Event()  # set when the current attempt connected or failed
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # ends a backoff early: a call wants the next attempt now, or a stop
        self._task: asyncio.Task[None] | None = None
        # What the upstream says to clients (server/serve/passthrough.py); its tools/list_changed lists again.
        self.relay = Relay(name, on_tools_changed=self.relist)
        self._relisting = asyncio.Lock()
        self.own_sessions: PerClient[UpstreamConnection] = PerClient()  # sessions = "per-client"

    @property
    def connected(self) -> bool:
        return self._client is not None and not self._lost.is_set()

    def client(self) -> Client | None:
        return self._client if self.connected else None

    def mark_lost(self, client: Client) -> None:
        """A call saw `client`'s connection break; a newer connection is not affected."""
        if client is self._client:
            self._lost.set()

    def for_caller(self) -> UpstreamConnection:
        """The session a call goes through: this one, or with `sessions = "per-client"` the calling
        client's own (it inherits what this one listed; the tools it serves stay this one's)."""
        caller = CALLER.get()
        if self.spec.sessions != "per-client" or caller is None:
            return self
        return self.own_sessions.get(caller, self._client_session)

    def _client_session(self) -> UpstreamConnection:
        session = UpstreamConnection(self.name, self.spec, self.connect_timeout)
        session.relay.hub = self.relay.hub
        # Started inside a call: its reader must not take that call's client for the caller of
        # everything it reads later.
        outside_any_call().run(session.start)
        return session

    def start(self) -> None:
        if self.spec.unset_reason is not None:  # it cannot start: its calls answer at once, saying why
            self.error = self.spec.unset_reason
            log.warning(
                "upstream %s cannot start: %s; its tools answer retryable errors (set it and restart)",
                self.name,
                self.error,
            )
            self._settle()
            return
        self._task = asyncio.create_task(self._supervise(), name=f"commitgate-upstream:{self.name}")

    async def first_attempt(self, timeout: float) -> None:
        await self.ready(timeout)

    async def ready(self, timeout: float) -> Client | None:
        """The session, after waiting (at most `timeout`) for an attempt under way to settle. Between
        attempts (the backoff after a lost connection or a failed one) a call starts the next attempt
        now and waits for it, rather than fail while the upstream may well be back."""
        if not self.connected and not self.connecting and self._task is not None and not self._stop.is_set():
            self.connecting, self._settled = True, asyncio.Event()
            self._wake.set()
        if not self.connected and self.connecting:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), timeout)
        return self.client()

    def _settle(self) -> None:
        self.connecting = False
        self._settled.set()

    async def aclose(self) -> None:
        await self.own_sessions.aclose()
        self._stop.set()
        self._wake.set()
        self._lost.set()  # a held session ends gracefully: its process is stopped by the SDK
        if self._task is None:
            return
        if not self.connecting:  # a slow start is not waited out: there is nothing to end gracefully
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), 10.0)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _supervise(self) -> None:
        delay = BACKOFF_INITIAL
        while not self._stop.is_set():
            started = time.monotonic()
            if self._settled.is_set():  # a new attempt: calls from now on wait for this one
                self.connecting, self._settled = True, asyncio.Event()
            try:
                await self._hold()
            except Exception as exc:  # a failing upstream must never take the server down
                said, self.error = self.error, self._why(exc)
                # a crash loop says why once, not at every attempt
                log.log(
                    logging.DEBUG if self.error == said else logging.WARNING,
                    "upstream %s: %s",
                    self.name,
                    self.error,
                )
            finally:
                self._client = None
                self._settle()
            if time.monotonic() - started > STABLE_AFTER:
                delay = BACKOFF_INITIAL
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay * random.uniform(0.5, 1.0))
            self._wake.clear()
            delay = min(delay * 2, BACKOFF_MAX)

    def _why(self, exc: BaseException) -> str:
        """A failed attempt's reason, in the user's words where the usual ones are known."""
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        command = self.spec.command
        if command is not None and isinstance(exc, FileNotFoundError):
            return f"cannot start {command!r}: no such command; is it installed, and on PATH?"
        if command is not None and isinstance(exc, PermissionError):
            return f"cannot start {command!r}: not executable"
        if command is not None and isinstance(exc, MCPError) and exc.code == types.CONNECTION_CLOSED:
            return "its process exited before answering; what it printed is in serve's log"
        return _reason(exc)

    async def _hold(self) -> None:
        lost = self._lost = asyncio.Event()
        async with AsyncExitStack() as stack:
            async with asyncio.timeout(self.connect_timeout):
                client = await stack.enter_async_context(
                    Client(
                        _transport(self.spec, lost),
                        cache=None,
                        mode=handshake(self.spec.command),
                        **self.relay.client_options(),
                    )
                )
                tools = await _list_all(client)
                await stack.enter_async_context(self.relay.watching(client))
            if tools != self.tools or not self.listed:
                if self.listed:
                    self._say_new_offer(tools)
                self.tools, self.listed = tools, True
                if self.on_new_tools is not None:
                    self.on_new_tools()
            self._client, self.error = client, None
            self.connects += 1
            self._settle()
            log.info("upstream %s: connected (%d tools)", self.name, len(self.tools))
            await lost.wait()
            self._client = None
            if not self._stop.is_set():
                self.error = "the connection was lost"
                log.warning("upstream %s: connection lost; reconnecting", self.name)

    async def relist(self) -> None:
        """List the tools again now (the upstream said they changed): new ones and changed
        definitions are served as at a reconnect. One listing at a time, so an older listing
        that answers late never replaces a newer one."""
        async with self._relisting:
            client = self.client()
            if client is None:
                return
            try:
                tools = await _list_all(client)
            except Exception as exc:  # the next connect lists them anyway
                log.warning("upstream %s: could not list its changed tools: %s", self.name, _reason(exc))
                return
            if tools != self.tools:
                self._say_new_offer(tools)
                self.tools = tools
                if self.on_new_tools is not None:
                    self.on_new_tools()

    def _say_new_offer(self, tools: dict[str, types.Tool]) -> None:
        """Log what a reconnected upstream offers now that it did not before, and what it dropped:
        a warning when that changes what is served (`tools = "all"`), else info."""
        added, dropped = sorted(tools.keys() - self.tools.keys()), sorted(self.tools.keys() - tools.keys())
        if not (added or dropped):
            return  # the same tools, other definitions: the refresh says so
        served = self.spec.tools == "all"
        log.log(
            logging.WARNING if served else logging.INFO,
            "upstream %s now offers other tools: new %s, gone %s (%s)",
            self.name,
            ", ".join(added) or "none",
            ", ".join(dropped) or "none",
            "served as their annotations say unless the policy has an entry"
            if served
            else 'only tools the policy lists are served (tools = "listed")',
        )


# --- the source --------------------------------------------------------------------------------------


def _without_key(schema: dict[str, Any]) -> dict[str, Any]:
    """The upstream's schema minus its own `idempotency_key`: the gateway adds (and checks) the key."""
    schema = dict(schema)
    schema.setdefault("type", "object")
    if KEY_ARGUMENT in schema.get("properties", {}):
        schema["properties"] = {k: v for k, v in schema["properties"].items() if k != KEY_ARGUMENT}
        schema["required"] = [r for r in schema.get("required", []) if r != KEY_ARGUMENT]
    return schema


RESERVED_META = "io.modelcontextprotocol/"  # the protocol's own keys (the upstream's server info)


def _own_meta(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """A result's `_meta` as the upstream's tool gave it: every key but the protocol's own."""
    kept = {k: v for k, v in (meta or {}).items() if not k.startswith(RESERVED_META)}
    return kept or None


def _text_of(result: types.CallToolResult) -> str:
    texts = [block.text for block in result.content if isinstance(block, types.TextContent)]
    return "\n".join(texts).strip()[:MAX_MESSAGE_CHARS] or "the upstream tool reported an error"


def tool_error(result: types.CallToolResult, where: str, keyed: bool) -> Exception:
    """An upstream `isError` result as an outcome. Its text is the upstream's (an argument echoed
    back, perhaps): it never makes a keyed call retryable or ambiguous, since the upstream ran it.
    Only a `safe-retry` tool, which has no effect to repeat, is retried on what the words say."""
    text = _text_of(result)
    detail = result.structured_content
    if keyed:
        return PermanentError(text, detail=detail)
    if _RATE_LIMITED.search(text):
        return RetryableError(f"{where}: {text}", detail=detail)
    if _TRANSIENT.search(text):
        return AmbiguousError(f"{where}: {text}; it may have been applied", detail=detail)
    return PermanentError(text, detail=detail)


class UpstreamTool:
    """A ToolSource proxying one tool of an upstream MCP server."""

    def __init__(self, name: str, policy: ToolPolicy, whole: Policy, using: Collaborators) -> None:
        if policy.upstream is None:
            raise DeclarationError(f"tools.{name}", "no `upstream` declared")
        self.name, self.upstream = name, policy.upstream
        self.upstream_tool = policy.upstream_tool or name
        self.timeout = policy.timeout
        self.keyed = policy.idempotency_class.keyed
        # None: not connected (yet), or built to be checked (policy check) and never called
        connection: UpstreamConnection | None = using.upstream(policy.upstream)
        self.connection = connection
        definition = connection.tools.get(self.upstream_tool) if connection else None
        if connection is not None and connection.listed and definition is None:
            offered = ", ".join(sorted(connection.tools)) or "none"
            raise DeclarationError(
                f"tools.{name}.upstream_tool",
                f"upstream {self.upstream!r} has no tool {self.upstream_tool!r} (it offers: {offered})",
            )
        self.declared = definition  # the upstream's own definition: its title and annotations are kept
        for warning in class_warnings(policy.idempotency_class.value, definition):
            said = f"tools.{name}: {warning}"
            if connection is not None and said not in connection.warned:
                connection.warned.add(said)
                log.warning("%s", said)
        imported = dict(definition.input_schema) if definition else None
        schema = policy.input_schema or imported or {"type": "object"}
        self.passes_key = KEY_ARGUMENT in (imported or schema).get("properties", {})
        self.input_schema = _without_key(schema)
        self.output_schema: dict[str, Any] | None = definition.output_schema if definition else None
        described = definition.description if definition else None
        self.description = (
            policy.description or described or f"{self.upstream_tool} (upstream {self.upstream})"
        )
        self._validator = SchemaValidator(self.input_schema, f"tools.{name}.input_schema")
        known = definition is not None or policy.input_schema is not None
        properties = set(self.input_schema.get("properties", {})) if known else None
        self._status: StatusCheck | None = status_check_for(
            name, policy.status_check, policy, properties, using
        )
        self.has_status_check = self._status is not None

    @property
    def _where(self) -> str:
        return f"upstream {self.upstream} tool {self.upstream_tool}"

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return self._validator.validate(arguments)

    async def call(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult:
        connection = self.connection.for_caller() if self.connection is not None else None
        # Waiting for a connection under way is part of the attempt: leave a little of its timeout
        # to say that nothing was sent rather than time out the attempt (an ambiguous failure).
        client = await connection.ready(self.timeout * 0.9) if connection is not None else None
        if connection is None or client is None:
            why = f": {connection.error}" if connection is not None and connection.error else ""
            raise RetryableError(f"upstream {self.upstream!r} is not connected{why}; the call was not sent")
        args = dict(arguments)
        meta: dict[str, Any] = {SESSION_META: ctx.session}
        if ctx.idempotency_key:
            meta[STEP_META] = ctx.idempotency_key
            if self.passes_key:
                args[KEY_ARGUMENT] = ctx.idempotency_key
        # The upstream's tools/call span joins this trace (the SDK's client refines it to its own span).
        traces.inject(meta)
        relay = connection.relay
        try:
            with relay.serving() as caller:  # the client's progress, logs and questions reach it
                result = await client.call_tool(
                    self.upstream_tool,
                    args,
                    progress_callback=relay.progress_callback(caller),
                    meta=typing.cast(Any, {**(caller.meta if caller else {}), **meta}),
                )
        except MCPError as exc:
            raise self._protocol_outcome(exc, connection, client) from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            connection.mark_lost(client)
            raise AmbiguousError(f"{self._where}: the connection broke during the call") from exc
        if result.is_error:
            raise tool_error(result, self._where, self.keyed)
        content = [
            block.model_dump(by_alias=True, mode="json", exclude_none=True) for block in result.content
        ]
        return ToolResult(content=content, structured=result.structured_content, meta=_own_meta(result.meta))

    def _protocol_outcome(self, exc: MCPError, connection: UpstreamConnection, client: Client) -> Exception:
        if exc.code == types.CONNECTION_CLOSED:
            connection.mark_lost(client)
            return AmbiguousError(
                f"{self._where}: the connection closed during the call; it may have been applied"
            )
        if exc.code in _REJECTED:
            return PermanentError(f"{self._where} rejected the call: {exc.message}")
        return AmbiguousError(f"{self._where}: {exc.message} (JSON-RPC error {exc.code})")

    async def status(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        if self._status is None:
            raise RuntimeError(f"tools.{self.name} declares no status check")
        return await self._status(arguments, ctx)


# --- all upstreams of a policy ---------------------------------------------------------------------


def used_upstreams(policy: Policy) -> set[str]:
    """The upstreams to connect: every one declared. One without a tool entry still offers its
    resources, prompts and completions (server/serve/passthrough.py); its tools stay unserved."""
    return set(policy.upstreams)


def implied_entries(
    policy: Policy, lookup: Callable[[str], UpstreamConnection | None]
) -> dict[str, ToolPolicy]:
    """The entries `tools = "all"` upstreams add: each offered tool without a [tools.X] entry of its
    own, with the class its annotations give (or the upstream's `default_class`). A name offered
    twice, already a policy tool, a meta tool's, or one no tool name can be (spaces, control or bidi
    characters, over 128 characters) becomes `UPSTREAM__TOOL` (docs/policy.md); an empty one is left
    out."""
    entered = {(t.upstream, t.upstream_tool or n) for n, t in policy.tools.items() if t.upstream}
    offered: list[tuple[str, types.Tool]] = []
    for name, spec in sorted(policy.upstreams.items()):
        connection = lookup(name) if spec.tools == "all" else None
        if connection is not None:
            offered += [(name, t) for n, t in sorted(connection.tools.items()) if (name, n) not in entered]
    counts: dict[str, int] = {}
    for _, tool in offered:
        counts[tool.name] = counts.get(tool.name, 0) + 1
    implied: dict[str, ToolPolicy] = {}
    for upstream, tool in offered:
        served = tool.name
        if not served:  # nothing to call it by: an entry's `upstream_tool` cannot name it either
            log.warning("upstream %s: a tool with an empty name is not served", upstream)
            continue
        if counts[served] > 1 or served in policy.tools or not usable_tool_name(served):
            served = prefixed_tool_name(upstream, tool.name)
        if served in policy.tools or served in implied:
            log.warning("upstream %s: tool %r is not served: its name is taken", upstream, tool.name)
            continue
        cls = policy.upstreams[upstream].default_class or proposed_class(tool.annotations)
        implied[served] = ToolPolicy.model_validate(
            {"class": cls, "upstream": upstream, "upstream_tool": tool.name}
        )
    return implied


def _key(name: str, spec: UpstreamPolicy) -> str:
    return f"{name}\0{spec.model_dump_json()}"


class UpstreamManager:
    """The upstream connections of one gateway, one per (name, declaration).

    At open: `update(policy)` connects what the policy uses; `lookup(policy)` lends the connections to sources. On a
    policy reload: `update(new, retire=False)` connects what is new while the old policy still
    serves; once the new policy is applied `retire(new)` closes what it no longer uses (after a
    rejected edit, `retire(current)` closes what was opened for nothing).
    """

    def __init__(self, *, connect_timeout: float | None = None) -> None:
        self.connect_timeout = connect_timeout  # None: each upstream's own
        self._pool: dict[str, UpstreamConnection] = {}
        # Set when a connection lists other tools than before (e.g. it was down at start): the
        # sources built from the old list are stale (server/reload.py rebuilds them).
        self.tools_changed = asyncio.Event()
        self.hub = Hub()  # where the upstreams' change notifications go (server/serve/passthrough.py)

    def connection(self, name: str, spec: UpstreamPolicy) -> UpstreamConnection | None:
        return self._pool.get(_key(name, spec))

    async def connect(self, upstreams: Mapping[str, UpstreamPolicy], *, wait: bool = True) -> None:
        """Hold a connection to each of `upstreams`; connections already held are kept as they are.

        With `wait`, return once each new connection's first attempt connected or failed."""
        fresh = []
        for name in sorted(upstreams):
            key = _key(name, upstreams[name])
            if key not in self._pool:
                connection = UpstreamConnection(name, upstreams[name], self.connect_timeout)
                connection.on_new_tools = self.tools_changed.set
                connection.relay.hub = self.hub
                connection.start()
                self._pool[key] = connection
                fresh.append(connection)
        if not wait:
            return
        await asyncio.gather(*(c.first_attempt(c.connect_timeout) for c in fresh))
        for connection in fresh:
            if not connection.connected and not connection.spec.unset_env:  # that one said so
                log.warning(
                    "upstream %s is not reachable (%s); its tools answer retryable errors until it is",
                    connection.name,
                    connection.error or "connect timed out",
                )

    async def retire(self, policy: Policy) -> None:
        """Close every connection `policy` does not use."""
        keep = {_key(name, policy.upstreams[name]) for name in used_upstreams(policy)}
        retired = [self._pool.pop(key) for key in list(self._pool) if key not in keep]
        await asyncio.gather(*(c.aclose() for c in retired))

    def lookup(self, policy: Policy) -> Callable[[str], UpstreamConnection | None]:
        """Upstream name -> the connection held for it under `policy` (what sources are given)."""
        return lambda name: (
            self.connection(name, policy.upstreams[name]) if name in policy.upstreams else None
        )

    async def update(self, policy: Policy, *, retire: bool = True, wait: bool = True) -> None:
        await self.connect({name: policy.upstreams[name] for name in used_upstreams(policy)}, wait=wait)
        if retire:
            await self.retire(policy)

    async def aclose(self) -> None:
        connections, self._pool = list(self._pool.values()), {}
        with processes.ended_on_sigterm():  # a client's SIGTERM now must not orphan a hung server
            await asyncio.gather(*(c.aclose() for c in connections))


@dataclass(frozen=True, slots=True)
class OfferedTool:
    """One tool an upstream offers, and how the policy serves it (`policy show --upstreams --json`)."""

    name: str
    served_as: str | None  # the name clients see; None when not served
    # the class it is served with; for a tool not served, the one its annotations give
    idempotency_class: str
    annotations: dict[str, Any]  # as the upstream declared them, wire names
    warnings: list[str]

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "served_as": self.served_as,
            "class": self.idempotency_class,
            "annotations": self.annotations,
            "warnings": self.warnings,
        }


@dataclass(frozen=True, slots=True)
class UpstreamInventory:
    """What `policy show` tells about one upstream."""

    name: str
    connected: bool
    error: str | None
    exposed: list[str]  # upstream tool names the policy serves
    not_exposed: list[str]  # offered by the upstream, not served ("available, not exposed")
    missing: list[str]  # declared in the policy, not offered by the upstream
    tools: list[OfferedTool]
    warnings: list[str] = field(default_factory=list)  # about the upstream itself (resources it shares)

    def as_json(self) -> dict[str, Any]:
        shown = {
            k: getattr(self, k)
            for k in ("name", "connected", "error", "exposed", "not_exposed", "missing", "warnings")
        }
        return {**shown, "tools": [tool.as_json() for tool in self.tools]}


async def inventory(policy: Policy, connect_timeout: float | None = None) -> list[UpstreamInventory]:
    """Connect once to every upstream the policy declares and compare what they offer with the policy."""
    manager = UpstreamManager(connect_timeout=connect_timeout)
    try:
        await manager.connect(policy.upstreams)
        lookup = manager.lookup(policy)
        served: dict[tuple[str, str], tuple[str, ToolPolicy]] = {}
        for n, t in {**policy.tools, **implied_entries(policy, lookup)}.items():
            key = (t.upstream or "", t.upstream_tool or n)
            if t.upstream and (key not in served or not served[key][1].expose):
                served[key] = (n, t)  # a tool served under two names is shown under the first
        found = [
            _inventory_of(name, connection, policy, served)
            for name in sorted(policy.upstreams)
            if (connection := lookup(name)) is not None
        ]
        await _warn_of_shared_uris(policy, lookup, found)
        return found
    finally:
        await manager.aclose()


async def _warn_of_shared_uris(
    policy: Policy, lookup: Callable[[str], UpstreamConnection | None], found: list[UpstreamInventory]
) -> None:
    """A resource URI two upstreams list is served by the first in policy order: warn of the others."""
    from commitgate.tools.upstream_catalog import duplicate_uris, listed_uris  # built on this module

    listings = []
    for name in policy.upstreams:
        connection = lookup(name)
        client = connection.client() if connection is not None else None
        if client is not None:
            with contextlib.suppress(Exception):  # no resources to say anything about
                listings.append((name, await listed_uris(client)))
    by_name = {item.name: item for item in found}
    for uri, owners in duplicate_uris(listings).items():
        for other in owners[1:]:
            by_name[other].warnings.append(
                f"resource {uri} is also listed by upstream {owners[0]}, which serves it (the first in"
                " policy order): this upstream's is never read"
            )


def _inventory_of(
    name: str,
    connection: UpstreamConnection,
    policy: Policy,
    served: Mapping[tuple[str, str], tuple[str, ToolPolicy]],
) -> UpstreamInventory:
    entries = [(t.upstream_tool or n, t.expose) for n, t in policy.tools.items() if t.upstream == name]
    tools = [_offered(tool, served.get((name, tool.name))) for _, tool in sorted(connection.tools.items())]
    return UpstreamInventory(
        name=name,
        connected=connection.listed,
        error=None if connection.listed else connection.error or "connect timed out",
        exposed=sorted(tool.name for tool in tools if tool.served_as is not None),
        not_exposed=sorted(tool.name for tool in tools if tool.served_as is None),
        missing=sorted({tool for tool, _ in entries if connection.listed and tool not in connection.tools}),
        tools=tools,
    )


def _offered(tool: types.Tool, entry: tuple[str, ToolPolicy] | None) -> OfferedTool:
    annotations = (
        tool.annotations.model_dump(by_alias=True, mode="json", exclude_none=True) if tool.annotations else {}
    )
    if entry is None or not entry[1].expose:
        cls = entry[1].idempotency_class.value if entry else proposed_class(tool.annotations)
        return OfferedTool(tool.name, None, cls, annotations, [])
    served_as, policy = entry
    cls = policy.idempotency_class.value
    return OfferedTool(tool.name, served_as, cls, annotations, class_warnings(cls, tool))
