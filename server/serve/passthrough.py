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

import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import mcp.types as types
from mcp import Client, MCPDeprecationWarning, MCPError
from mcp.server import Server, ServerRequestContext
from mcp.server.subscriptions import PromptsListChanged, ResourcesListChanged, ResourceUpdated
from mcp.shared.exceptions import NoBackChannelError
from mcp.shared.message import ServerMessageMetadata
from pydantic import BaseModel, ConfigDict

from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.reload import ToolListAnnouncer
from commitgate.tools.upstream import used_upstreams
from commitgate.tools.upstream_catalog import Catalog, Upstreams
from commitgate.tools.upstream_relay import LOG_LEVEL_META, calling, not_supported

log = logging.getLogger("commitgate.passthrough")

_T = TypeVar("_T")

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


def _quietly(make: Callable[[], _T]) -> _T:
    return make()


@dataclass(frozen=True, slots=True)
class SessionCaller:
    """The client of one request, reached through the SDK's request context."""

    ctx: ServerRequestContext[Any, Any]

    @property
    def client(self) -> object:
        # The SDK keeps the connection behind the per-request session; it has no public accessor.
        return getattr(self.ctx.session, "_connection", None) or self.ctx.session

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
        session = self.ctx.session
        await _quietly(
            lambda: session.send_log_message(
                params.level, params.data, params.logger, related_request_id=self.ctx.request_id
            )
        )

    async def progress(self, progress: float, total: float | None, message: str | None) -> None:
        await self.ctx.session.report_progress(progress, total, message)


@contextlib.contextmanager
def caller_of(ctx: ServerRequestContext[Any, Any]) -> Any:
    """While a request is served, its client is the caller (the tasks it starts inherit it)."""
    with calling(SessionCaller(ctx)):
        yield


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
        for method, params_type, handler in handlers:
            server.add_request_handler(method, params_type, handler)
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
        upstreams = self.connected()
        owner = await self.catalog.resource_owner(params.uri, upstreams)
        client = self._client(owner, upstreams)
        fresh = not self._subscribers.get(params.uri)
        connection = getattr(ctx.session, "_connection", None)
        if connection is not None:
            self._subscribers.setdefault(params.uri, weakref.WeakSet()).add(connection)
        if fresh:  # one upstream subscription serves every client subscribed to the URI
            await _quietly(lambda: client.subscribe_resource(params.uri))
        return types.EmptyResult()

    async def unsubscribe(
        self, ctx: ServerRequestContext[Any, Any], params: types.UnsubscribeRequestParams
    ) -> types.EmptyResult:
        subscribers = self._subscribers.get(params.uri)
        connection = getattr(ctx.session, "_connection", None)
        if subscribers is not None and connection is not None:
            subscribers.discard(connection)
        if not subscribers:
            self._subscribers.pop(params.uri, None)
            upstreams = self.connected()
            with contextlib.suppress(MCPError):
                owner = await self.catalog.resource_owner(params.uri, upstreams)
                await _quietly(lambda: self._client(owner, upstreams).unsubscribe_resource(params.uri))
        return types.EmptyResult()

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
                await _quietly(lambda c=client: c.set_logging_level(params.level))  # type: ignore[misc]
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
                await _send(functools.partial(connection.send_resource_updated, uri))
        elif isinstance(notification, types.ResourceListChangedNotification):
            await self.announcer.announce(ResourcesListChanged(), lambda c: c.send_resource_list_changed())
        elif isinstance(notification, types.PromptListChangedNotification):
            await self.announcer.announce(PromptsListChanged(), lambda c: c.send_prompt_list_changed())


async def _send(send: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(Exception):  # a client that went away
        await send()


def has_upstreams(gateway: Gateway) -> bool:
    return bool(gateway.policy.upstreams)
