"""Everything but the guard passes through: what wrapped upstreams offer besides tools.

Installed on the MCP server when the policy has an upstream. It serves resources, resource
templates, prompts (tools/upstream_catalog.py merges and routes them), completions and
`logging/setLevel` from the connected upstreams; forwards subscriptions and passes the upstreams'
change notifications on (handshake-era clients on their connection, 2026-07-28 clients on their
`subscriptions/listen` streams); and puts the caller of each request in `upstream_relay.CALLER`,
so an upstream's questions, progress and log messages while serving it reach that client only.

A request no connected upstream can serve answers as a server without that capability would: an
empty list, an unknown prompt or resource, an empty completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
import warnings
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import mcp.types as types
from mcp import Client, MCPDeprecationWarning, MCPError
from mcp.server import Server, ServerRequestContext
from mcp.server.subscriptions import PromptsListChanged, ResourcesListChanged, ResourceUpdated
from mcp.shared.exceptions import NoBackChannelError
from mcp.shared.message import ServerMessageMetadata
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel, ConfigDict

from commitgate.server.model.facts import SESSION_META
from commitgate.server.serve.auth import principal_of_request
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.reload import ToolListAnnouncer
from commitgate.tools.upstream import used_upstreams
from commitgate.tools.upstream_catalog import Catalog, Upstreams
from commitgate.tools.upstream_relay import LOG_LEVEL_META, calling, not_supported

log = logging.getLogger("commitgate.passthrough")

_CAPABILITY = {
    "sampling/createMessage": types.ClientCapabilities(sampling=types.SamplingCapability()),
    "elicitation/create": types.ClientCapabilities(elicitation=types.ElicitationCapability()),
    "roots/list": types.ClientCapabilities(roots=types.RootsCapability()),
}
_REQUESTS: dict[str, type[BaseModel]] = {
    "sampling/createMessage": types.CreateMessageRequest,
    "elicitation/create": types.ElicitRequest,
    "roots/list": types.ListRootsRequest,
}


class _Answer(BaseModel):
    """A client's answer, every field kept: it goes back upstream as the client sent it."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True, slots=True)
class SessionCaller:
    """The client of one request, reached through the SDK's request context."""

    ctx: ServerRequestContext[Any, Any]

    @property
    def _connection(self) -> Any:
        # The SDK keeps the connection behind the per-request session; it has no public accessor.
        return getattr(self.ctx.session, "_connection", None)

    @property
    def _has_session(self) -> bool:
        return self.ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS and self._connection is not None

    @property
    def client(self) -> object:
        if self._has_session:
            return self._connection
        # 2026-07-28: no transport session; the principal and commitgate session stand for it
        session = (self.ctx.meta or {}).get(SESSION_META)
        return ("client", principal_of_request(), session)

    def when_gone(self, close: Callable[[], Awaitable[None]]) -> bool:
        if not self._has_session:
            return False
        self._connection.exit_stack.push_async_callback(close)
        return True

    @property
    def meta(self) -> dict[str, Any]:
        level = (self.ctx.meta or {}).get(LOG_LEVEL_META)
        return {LOG_LEVEL_META: level} if level else {}

    @property
    def wants_progress(self) -> bool:
        meta: Any = self.ctx.meta or {}  # parsed: the token as `progress_token`
        return meta.get("progress_token", meta.get("progressToken")) is not None

    async def request(
        self, method: str, params: types.RequestParams | None
    ) -> dict[str, Any] | types.ErrorData:
        try:
            declared = self.ctx.session.check_client_capability(_CAPABILITY[method])
        except Exception:
            declared = False
        if not declared:
            return not_supported(method)
        request = _REQUESTS[method].model_validate({"method": method, "params": params})
        related = ServerMessageMetadata(related_request_id=self.ctx.request_id)
        try:
            answer = await self.ctx.session.send_request(request, _Answer, metadata=related)  # type: ignore[arg-type]
        except NoBackChannelError:  # a 2026-07-28 client: it has no channel for a question mid-call
            return not_supported(method)
        except MCPError as exc:
            return exc.error
        return answer.model_dump(by_alias=True, mode="json", exclude_none=True)

    async def log(self, params: types.LoggingMessageNotificationParams) -> None:
        await self.ctx.session.send_log_message(
            params.level, params.data, params.logger, related_request_id=self.ctx.request_id
        )

    async def progress(self, progress: float, total: float | None, message: str | None) -> None:
        await self.ctx.session.report_progress(progress, total, message)


@contextlib.contextmanager
def caller_of(ctx: ServerRequestContext[Any, Any]) -> Any:
    """While a request is served, its client is the caller (the tasks it starts inherit it)."""
    with calling(SessionCaller(ctx)):
        yield


# --- 2026-07-28 clients: an upstream's questions as rounds of the call ---------------------------------

ROUND_PREFIX = "relay:"
KEEP_FINISHED = 300.0  # seconds a finished call waits for its client to come back for the answer


@dataclass(frozen=True, slots=True)
class _Question:
    key: str
    request: Any  # ElicitRequest | CreateMessageRequest | ListRootsRequest
    answer: asyncio.Future[dict[str, Any] | types.ErrorData]


class _Paused:
    """A call of a 2026-07-28 client, running on while its client answers the upstream's questions."""

    def __init__(self, ident: str, task: asyncio.Task[Any]) -> None:
        self.ident, self.task = ident, task
        self.questions: asyncio.Queue[_Question] = asyncio.Queue()
        self.open: dict[str, _Question] = {}
        self.asked = 0

    async def next_round(self) -> Any:
        """The call's answer once it has one, or the next question for its client."""
        asking = asyncio.ensure_future(self.questions.get())
        try:
            await asyncio.wait({self.task, asking}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            asking.cancel()
        if asking.done() and not asking.cancelled():
            first = asking.result()
            found = {first.key: first}
            while not self.questions.empty():  # questions asked at once go in one round
                more = self.questions.get_nowait()
                found[more.key] = more
            self.open.update(found)
            requests = {key: question.request for key, question in found.items()}
            return types.InputRequiredResult(input_requests=requests, request_state=ROUND_PREFIX + self.ident)
        return self.task.result()

    def answer(self, responses: Mapping[str, Any]) -> None:
        for key, response in responses.items():
            question = self.open.pop(key, None)
            if question is None or question.answer.done():
                continue
            dumped = response.model_dump(by_alias=True, mode="json", exclude_none=True)
            question.answer.set_result(
                dumped if "code" not in dumped else types.ErrorData.model_validate(dumped)
            )


@dataclass(frozen=True, slots=True)
class RoundsCaller(SessionCaller):
    """A 2026-07-28 client's call: its upstream's questions become the call's next round."""

    paused: _Paused | None = None

    async def request(
        self, method: str, params: types.RequestParams | None
    ) -> dict[str, Any] | types.ErrorData:
        if self.paused is None or not self.ctx.session.check_client_capability(_CAPABILITY[method]):
            return not_supported(method)
        self.paused.asked += 1
        question = _Question(
            f"{method}#{self.paused.asked}",
            _REQUESTS[method].model_validate({"method": method, "params": params}),
            asyncio.get_running_loop().create_future(),
        )
        await self.paused.questions.put(question)
        return await question.answer


class Rounds:
    """tools/call of 2026-07-28 clients that can be asked: the call runs in a task of its own, so an
    upstream's question (elicitation, sampling, roots) can be answered as an `InputRequiredResult`
    and the call go on when the client comes back with the answer (the sealed request state names
    the paused call; the SDK's boundary binds it to the principal)."""

    def __init__(self) -> None:
        self._paused: dict[str, _Paused] = {}

    @staticmethod
    def applies(ctx: ServerRequestContext[Any, Any]) -> bool:
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            return False
        with contextlib.suppress(Exception):
            return any(ctx.session.check_client_capability(c) for c in _CAPABILITY.values())
        return False

    async def call(
        self,
        ctx: ServerRequestContext[Any, Any],
        params: types.CallToolRequestParams,
        run: Callable[[], Awaitable[Any]],
    ) -> Any:
        state = params.request_state or ""
        if state.startswith(ROUND_PREFIX):
            paused = self._paused.get(state.removeprefix(ROUND_PREFIX))
            if paused is None:
                raise MCPError(types.INVALID_PARAMS, "this call's earlier round is over; call the tool again")
            paused.answer(params.input_responses or {})
            return await self._round(paused)
        ident = uuid.uuid4().hex
        holder: list[_Paused] = []

        async def running() -> Any:
            with calling(RoundsCaller(ctx, holder[0])):
                return await run()

        task = asyncio.get_running_loop().create_task(running(), name=f"commitgate-rounds:{ident}")
        paused = _Paused(ident, task)
        holder.append(paused)
        self._paused[ident] = paused
        task.add_done_callback(
            lambda _: asyncio.get_running_loop().call_later(KEEP_FINISHED, self._paused.pop, ident, None)
        )
        return await self._round(paused)

    async def _round(self, paused: _Paused) -> Any:
        try:
            answer = await paused.next_round()
        except asyncio.CancelledError:  # the client cancelled its call: so is the call (a keyed
            paused.task.cancel()  # operation runs on in the commit boundary's own task)
            raise
        if not isinstance(answer, types.InputRequiredResult):
            self._paused.pop(paused.ident, None)
        return answer


class Passthrough:
    """The requests of upstream capabilities, and the upstreams' change notifications."""

    def __init__(self, gateway: Gateway, announcer: ToolListAnnouncer | None) -> None:
        self.gateway, self.announcer = gateway, announcer
        self.catalog = Catalog()
        self._subscribers: dict[str, weakref.WeakSet[Any]] = {}  # URI -> handshake-era connections

    def connected(self) -> list[tuple[str, Client]]:
        """The upstreams the policy uses that are connected now, in policy order."""
        policy = self.gateway.policy
        lookup = self.gateway.upstreams.lookup(policy)
        used = used_upstreams(policy)
        found = []
        for name in policy.upstreams:
            connection = lookup(name) if name in used else None
            client = connection.client() if connection is not None else None
            if client is not None:
                found.append((name, client))
        return found

    def _client(self, name: str, upstreams: Upstreams) -> Client:
        for upstream, client in upstreams:
            if upstream == name:
                return client
        raise MCPError(types.INTERNAL_ERROR, f"upstream {name!r} is not connected; try again shortly")

    def install(self, server: Server[Any]) -> None:
        handlers: list[tuple[str, type[BaseModel], Any]] = [
            ("resources/list", types.PaginatedRequestParams, self.list_resources),
            ("resources/templates/list", types.PaginatedRequestParams, self.list_resource_templates),
            ("resources/read", types.ReadResourceRequestParams, self.read_resource),
            ("resources/subscribe", types.SubscribeRequestParams, self.subscribe),
            ("resources/unsubscribe", types.UnsubscribeRequestParams, self.unsubscribe),
            ("prompts/list", types.PaginatedRequestParams, self.list_prompts),
            ("prompts/get", types.GetPromptRequestParams, self.get_prompt),
            ("completion/complete", types.CompleteRequestParams, self.complete),
            ("logging/setLevel", types.SetLevelRequestParams, self.set_level),
        ]
        # commitgate relays the features the 2026-07-28 era deprecates (logging, roots, subscriptions)
        # to clients and upstreams that speak them: the SDK's warnings would only be noise in its log.
        warnings.filterwarnings("ignore", category=MCPDeprecationWarning)
        if self.announcer is not None:
            handlers.append(("subscriptions/listen", types.SubscriptionsListenRequestParams, self.listen))
        for method, params_type, handler in handlers:
            server.add_request_handler(method, params_type, handler)
        server.passes_through = True  # type: ignore[attr-defined]  # advertises their listChanged
        self.gateway.upstreams.hub.notice = self.notice

    # --- requests ---------------------------------------------------------------------------------

    async def list_resources(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=await self.catalog.resources(self.connected()))

    async def list_resource_templates(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams
    ) -> types.ListResourceTemplatesResult:
        templates = await self.catalog.resource_templates(self.connected())
        return types.ListResourceTemplatesResult(resource_templates=templates)

    async def read_resource(
        self, ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        upstreams = self.connected()
        owner = await self.catalog.resource_owner(params.uri, upstreams)
        with caller_of(ctx):
            return await self._client(owner, upstreams).read_resource(params.uri)

    async def subscribe(
        self, ctx: ServerRequestContext[Any, Any], params: types.SubscribeRequestParams
    ) -> types.EmptyResult:
        await self._hold(params.uri, getattr(ctx.session, "_connection", None) or _Listening())
        return types.EmptyResult()

    async def unsubscribe(
        self, ctx: ServerRequestContext[Any, Any], params: types.UnsubscribeRequestParams
    ) -> types.EmptyResult:
        await self._release(params.uri, getattr(ctx.session, "_connection", None))
        return types.EmptyResult()

    async def listen(
        self, ctx: ServerRequestContext[Any, Any], params: types.SubscriptionsListenRequestParams
    ) -> Any:
        """A 2026-07-28 client's stream of changes: the resources it names are subscribed upstream
        while it lasts."""
        assert self.announcer is not None
        uris = list(params.notifications.resource_subscriptions or ())
        holder = _Listening()
        try:
            for uri in uris:
                with contextlib.suppress(MCPError):  # a URI nobody lists: nothing to subscribe to
                    await self._hold(uri, holder)
            return await self.announcer.listen(ctx, params)
        finally:
            with anyio.move_on_after(10, shield=True):  # the stream ends by being cancelled
                for uri in uris:
                    with contextlib.suppress(Exception):
                        await self._release(uri, holder)

    async def _hold(self, uri: str, holder: object) -> None:
        """One upstream subscription per URI serves every client subscribed to it."""
        upstreams = self.connected()
        owner = await self.catalog.resource_owner(uri, upstreams)
        client = self._client(owner, upstreams)
        fresh = not self._subscribers.get(uri)
        self._subscribers.setdefault(uri, weakref.WeakSet()).add(holder)
        if fresh:
            await client.subscribe_resource(uri)

    async def _release(self, uri: str, holder: object | None) -> None:
        subscribers = self._subscribers.get(uri)
        if subscribers is not None and holder is not None:
            subscribers.discard(holder)
        if not subscribers:
            self._subscribers.pop(uri, None)
            upstreams = self.connected()
            with contextlib.suppress(MCPError):
                owner = await self.catalog.resource_owner(uri, upstreams)
                await self._client(owner, upstreams).unsubscribe_resource(uri)

    async def list_prompts(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams
    ) -> types.ListPromptsResult:
        return types.ListPromptsResult(prompts=await self.catalog.prompts(self.connected()))

    async def get_prompt(
        self, ctx: ServerRequestContext[Any, Any], params: types.GetPromptRequestParams
    ) -> types.GetPromptResult:
        upstreams = self.connected()
        owner, name = await self.catalog.prompt_owner(params.name, upstreams)
        with caller_of(ctx):
            return await self._client(owner, upstreams).get_prompt(name, params.arguments)

    async def complete(
        self, ctx: ServerRequestContext[Any, Any], params: types.CompleteRequestParams
    ) -> types.CompleteResult:
        upstreams = self.connected()
        ref = params.ref
        if isinstance(ref, types.PromptReference):
            try:
                owner, name = await self.catalog.prompt_owner(ref.name, upstreams)
            except MCPError:
                owner = None
            ref = ref.model_copy(update={"name": name}) if owner else ref
        else:
            owner = await self.catalog.template_owner(ref.uri, upstreams)
        if owner is None:
            return types.CompleteResult(completion=types.Completion(values=[]))
        context = params.context.arguments if params.context else None
        argument = {"name": params.argument.name, "value": params.argument.value}
        return await self._client(owner, upstreams).complete(ref, argument, context)

    async def set_level(
        self, ctx: ServerRequestContext[Any, Any], params: types.SetLevelRequestParams
    ) -> types.EmptyResult:
        for name, client in self.connected():
            if client.server_capabilities.logging is None:
                continue
            try:
                await client.set_logging_level(params.level)
            except MCPError as exc:  # one upstream's refusal leaves the others' level set
                log.info("upstream %s refused logging/setLevel: %s", name, exc.error.message)
        return types.EmptyResult()

    # --- notifications ----------------------------------------------------------------------------

    async def notice(self, upstream: str, notification: types.ServerNotification) -> None:
        """An upstream's change notification, passed on to the clients it concerns."""
        if self.announcer is None:
            return
        if isinstance(notification, types.ResourceUpdatedNotification):
            uri = notification.params.uri
            await self.announcer.bus.publish(ResourceUpdated(uri=uri))
            for connection in list(self._subscribers.get(uri, ())):
                if not isinstance(connection, _Listening):  # those have it on their stream
                    await _send(functools.partial(connection.send_resource_updated, uri))
        elif isinstance(notification, types.ResourceListChangedNotification):
            await self.announcer.announce(ResourcesListChanged(), lambda c: c.send_resource_list_changed())
        elif isinstance(notification, types.PromptListChangedNotification):
            await self.announcer.announce(PromptsListChanged(), lambda c: c.send_prompt_list_changed())


class _Listening:
    """Holds a subscription for a `subscriptions/listen` stream (or a client with no connection)."""


async def _send(send: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(Exception):  # a client that went away
        await send()


async def relayed_call(
    ctx: ServerRequestContext[Any, Any],
    params: types.CallToolRequestParams,
    run: Callable[[], Awaitable[Any]],
    rounds: Rounds | None,
) -> Any:
    """Serve a tools/call with its client as the caller of everything the call causes upstream."""
    if rounds is not None and rounds.applies(ctx):
        return await rounds.call(ctx, params, run)
    with caller_of(ctx):
        return await run()


def has_upstreams(gateway: Gateway) -> bool:
    return bool(gateway.policy.upstreams)
