"""Everything but the guard passes through: what wrapped upstreams offer besides tools.

Installed on the MCP server when the policy has an upstream. It serves resources, resource
templates, prompts (tools/upstream_catalog.py merges and routes them), completions and
`logging/setLevel` from the connected upstreams; forwards subscriptions and passes the upstreams'
change notifications on (handshake-era clients on their connection, 2026-07-28 clients on their
`subscriptions/listen` streams). Reads and prompts are served with their client as the caller
(callers.py), so an upstream's questions while serving them reach that client only.

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
from typing import Any

import anyio
import mcp.types as types
from mcp import Client, MCPDeprecationWarning, MCPError
from mcp.server import Server, ServerRequestContext
from mcp.server.subscriptions import PromptsListChanged, ResourcesListChanged, ResourceUpdated
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel

from commitgate.server.serve.callers import SessionCaller, caller_of
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.reload import ToolListAnnouncer
from commitgate.tools.upstream import used_upstreams
from commitgate.tools.upstream_catalog import Catalog, Upstreams

log = logging.getLogger("commitgate.passthrough")


class Passthrough:
    """The requests of upstream capabilities, and the upstreams' change notifications."""

    def __init__(self, gateway: Gateway, announcer: ToolListAnnouncer | None) -> None:
        self.gateway, self.announcer = gateway, announcer
        self.catalog = Catalog()
        # URI -> who is subscribed: handshake-era connections, 2026-07-28 listen streams
        self._subscribers: dict[str, weakref.WeakSet[Any]] = {}

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
        SessionCaller(ctx).remember_log_level(params.level)
        for name, client in self.connected():
            if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
                continue  # it logs per request, at the level each call carries
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


def has_upstreams(gateway: Gateway) -> bool:
    return bool(gateway.policy.upstreams)
