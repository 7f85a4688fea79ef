"""What an upstream says to the client while it serves a call, relayed to that client and no other.

An upstream MCP server may, while serving a call, ask the client something (elicitation,
`sampling/createMessage`, `roots/list`), report progress or send log messages; it may also tell
that its resources, prompts or tools changed. commitgate stands between the two, so it relays:

* requests and logs go to the **caller**: the client whose call the upstream is serving. The
  serving layer puts a `Caller` in `CALLER` while it handles a request; every task the call starts
  (the commit boundary's attempts included) inherits it. A request the upstream makes inside the
  call's own task (2026-07-28 upstreams answer `InputRequiredResult`, which the SDK's client turns
  into our callbacks right there) is the caller's for sure. One the upstream sends on its own
  channel (handshake era) carries no link to the call, so it is the caller's only when exactly one
  call is in flight on that upstream session; with several, nobody's: the upstream gets the answer
  a client without that capability gives, and a log line is dropped. Never another client's.
* progress goes back under the client's own `progressToken`: each upstream call gets a token of
  its own (the SDK's), whose notifications are mapped back to the caller's request.
* change notifications (`resources/updated`, `…/list_changed`) go to the `Hub`, which the serving
  layer connects to its clients (server/serve/passthrough.py). An upstream's own
  `tools/list_changed` makes its connection list its tools again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import anyio
import mcp.types as types
from mcp import Client
from mcp.client.session import ClientRequestContext
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

log = logging.getLogger("commitgate.tools.upstream_relay")

LOG_LEVEL_META = "io.modelcontextprotocol/logLevel"  # a 2026-07-28 request's opt-in to log messages

# What a client without the capability answers (the MCP SDK's client, word for word).
NOT_SUPPORTED = {
    "sampling/createMessage": "Sampling not supported",
    "elicitation/create": "Elicitation not supported",
    "roots/list": "List roots not supported",
}


def not_supported(method: str) -> types.ErrorData:
    return types.ErrorData(code=types.INVALID_REQUEST, message=NOT_SUPPORTED[method])


class Caller(Protocol):
    """The client whose request commitgate is serving: how to reach it (built by the serving layer)."""

    @property
    def client(self) -> object:
        """The client's session (for `sessions = "per-client"`): the same object for all its calls."""
        ...

    @property
    def meta(self) -> dict[str, Any]:
        """`_meta` keys of the client's request to pass on upstream (its log-level opt-in)."""
        ...

    @property
    def wants_progress(self) -> bool: ...

    async def request(
        self, method: str, params: types.RequestParams | None
    ) -> dict[str, Any] | types.ErrorData:
        """Relay a request to the client; its result (wire shape) or the error it answered."""
        ...

    async def log(self, params: types.LoggingMessageNotificationParams) -> None: ...

    async def progress(self, progress: float, total: float | None, message: str | None) -> None: ...

    def when_gone(self, close: Callable[[], Awaitable[None]]) -> bool:
        """Have `close` run when the client's session ends; False if it has none (2026-07-28)."""
        ...


CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("commitgate_caller", default=None)


@contextlib.contextmanager
def calling(caller: Caller | None) -> Iterator[None]:
    """`caller` is the one served in this block (and in every task started in it)."""
    token = CALLER.set(caller)
    try:
        yield
    finally:
        CALLER.reset(token)


def outside_any_call() -> contextvars.Context:
    """A context with no caller, for long-lived tasks (an upstream session's reader must never
    take the call that happened to open it for the caller of everything it reads later)."""
    context = contextvars.copy_context()
    context.run(CALLER.set, None)
    return context


# --- notifications to the clients --------------------------------------------------------------------

Notice = Callable[[str, types.ServerNotification], Awaitable[None]]


@dataclass
class Hub:
    """Where upstream change notifications go: the serving layer sets `notice` (upstream name, the
    notification as the upstream sent it). Until then they are dropped."""

    notice: Notice | None = None

    async def tell(self, upstream: str, notification: types.ServerNotification) -> None:
        if self.notice is None:
            return
        try:
            await self.notice(upstream, notification)
        except Exception:  # a client that went away must never break the upstream's reader
            log.exception("upstream %s: could not pass on %s", upstream, notification.method)


# --- sessions = "per-client" ------------------------------------------------------------------------


class Closable(Protocol):
    async def aclose(self) -> None: ...


_S = TypeVar("_S", bound=Closable)


class PerClient(Generic[_S]):
    """One upstream session per client session: opened at the client's first call, closed when its
    session ends (a 2026-07-28 client has none: its principal and commitgate session stand for it,
    kept until the server stops)."""

    def __init__(self) -> None:
        self._sessions: dict[object, _S] = {}

    def get(self, caller: Caller, open_session: Callable[[], _S]) -> _S:
        key = caller.client
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = open_session()
            caller.when_gone(lambda: self._close(key))
        return session

    async def _close(self, key: object) -> None:
        session = self._sessions.pop(key, None)
        if session is not None:
            await session.aclose()

    async def aclose(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.aclose() for s in sessions), return_exceptions=True)


# --- one upstream session ----------------------------------------------------------------------------


@dataclass
class Relay:
    """The relay of one upstream session: the callbacks its `Client` gets, and its calls in flight."""

    upstream: str
    hub: Hub = field(default_factory=Hub)
    on_tools_changed: Callable[[], Coroutine[Any, Any, None]] | None = None  # list the tools again
    _inflight: list[Caller] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def watching(self, client: Client) -> AsyncIterator[None]:
        """While connected: a 2026-07-28 upstream says what changed only on a `subscriptions/listen`
        stream, so one stays open (each event reaches `_message` as a notification)."""
        if client.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            yield
            return
        async with anyio.create_task_group() as group:
            group.start_soon(self._listen, client)
            try:
                yield
            finally:
                group.cancel_scope.cancel()

    async def _listen(self, client: Client) -> None:
        try:
            changes = client.listen(
                tools_list_changed=True, prompts_list_changed=True, resources_list_changed=True
            )
            async with changes as events:
                async for _ in events:
                    pass
        except Exception as exc:  # an upstream without listen streams: nothing changes, then
            log.info("upstream %s: no change notifications (%s)", self.upstream, type(exc).__name__)

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for the upstream's `Client`: commitgate declares what a client may
        declare, and answers for its caller."""
        return {
            "sampling_callback": self._sampling,
            "elicitation_callback": self._elicitation,
            "list_roots_callback": self._roots,
            "logging_callback": self._log,
            "message_handler": self._message,
        }

    @contextlib.contextmanager
    def serving(self) -> Iterator[Caller | None]:
        """The caller of the current request, counted in flight on this session while it lasts."""
        caller = CALLER.get()
        if caller is None:
            yield None
            return
        self._inflight.append(caller)
        try:
            yield caller
        finally:
            self._inflight.remove(caller)

    def progress_callback(self, caller: Caller | None) -> Any:
        if caller is None or not caller.wants_progress:
            return None

        async def relay(progress: float, total: float | None, message: str | None) -> None:
            with contextlib.suppress(Exception):  # the client may have gone; the call goes on
                await caller.progress(progress, total, message)

        return relay

    def whose(self) -> Caller | None:
        """The caller a request or log of this session belongs to, when that can be told."""
        caller = CALLER.get()
        if caller is not None:  # asked inside the call's own task
            return caller
        clients = {id(c.client) for c in self._inflight}
        # Several calls of one client (always so on a per-client session): that client it is.
        return self._inflight[-1] if len(clients) == 1 else None

    async def _ask(self, method: str, params: types.RequestParams | None) -> Any:
        caller = self.whose()
        if caller is None:
            log.info(
                "upstream %s: %s answered as unsupported: no single caller to ask", self.upstream, method
            )
            return not_supported(method)
        return await caller.request(method, params)

    async def _sampling(self, context: ClientRequestContext, params: types.CreateMessageRequestParams) -> Any:
        answer = await self._ask("sampling/createMessage", params)
        if isinstance(answer, types.ErrorData):
            return answer
        try:
            return types.CreateMessageResult.model_validate(answer)
        except ValidationError:  # content with tool use: the other shape
            return types.CreateMessageResultWithTools.model_validate(answer)

    async def _elicitation(self, context: ClientRequestContext, params: types.ElicitRequestParams) -> Any:
        answer = await self._ask("elicitation/create", params)
        return answer if isinstance(answer, types.ErrorData) else types.ElicitResult.model_validate(answer)

    async def _roots(self, context: ClientRequestContext) -> Any:
        answer = await self._ask("roots/list", None)
        return answer if isinstance(answer, types.ErrorData) else types.ListRootsResult.model_validate(answer)

    async def _log(self, params: types.LoggingMessageNotificationParams) -> None:
        caller = self.whose()
        if caller is None:
            return  # nobody's for sure: telling anyone might tell the wrong principal
        named = params.model_copy(update={"logger": f"{self.upstream}/{params.logger or ''}".rstrip("/")})
        with contextlib.suppress(Exception):
            await caller.log(named)

    async def _message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            if self.on_tools_changed is not None:
                asyncio.get_running_loop().create_task(self.on_tools_changed(), context=outside_any_call())
            return
        if isinstance(
            message,
            types.ResourceUpdatedNotification
            | types.ResourceListChangedNotification
            | types.PromptListChangedNotification,
        ):
            await self.hub.tell(self.upstream, message)
