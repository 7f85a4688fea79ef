"""The resources, resource templates and prompts of every connected upstream, as one server's.

Listings are merged in policy order, each upstream paginated through (a client sees one list).
A URI is never rewritten: clients and tools' `_meta` refer to it. When two upstreams list the
same URI the first serves it (`policy show --upstreams` warns). A prompt name two upstreams
share is served as `UPSTREAM__NAME` for both, as tool names are. Each listing remembers where
what it listed came from, so a read, a get or a completion goes to the upstream that offered it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mcp.types as types
from mcp import Client, MCPError
from mcp.shared.uri_template import UriTemplate

from commitgate.server.policy.rules import SHARED_NAME

RESOURCE_NOT_FOUND = -32002  # MCP's code for a URI no server offers

Upstreams = Sequence[tuple[str, Client]]  # connected upstreams, in policy order

_MAX_PAGES = 100  # a paginator that never ends cannot hang a listing


async def _all_pages(client: Client, method: str, items: str) -> list[Any]:
    """Every item of a listing (`client.<method>`), page after page."""
    fetch: Callable[..., Awaitable[Any]] = getattr(client, method)
    found: list[Any] = []
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        page = await fetch(cursor=cursor)
        found += getattr(page, items)
        cursor = page.next_cursor
        if not cursor:
            break
    return found


def offers(client: Client, capability: str) -> bool:
    return getattr(client.server_capabilities, capability, None) is not None


@dataclass
class Catalog:
    """What the last listings found, and where each thing came from."""

    resource_routes: dict[str, str] = field(default_factory=dict)  # URI -> upstream
    templates: list[tuple[UriTemplate, str, str]] = field(default_factory=list)  # parsed, text, upstream
    prompt_routes: dict[str, tuple[str, str]] = field(default_factory=dict)  # served name -> upstream, name

    async def resources(self, upstreams: Upstreams) -> list[types.Resource]:
        listed: list[types.Resource] = []
        routes: dict[str, str] = {}
        for name, client in upstreams:
            if not offers(client, "resources"):
                continue
            for resource in await _all_pages(client, "list_resources", "resources"):
                if resource.uri not in routes:  # the first in policy order serves it
                    routes[resource.uri] = name
                    listed.append(resource)
        self.resource_routes = routes
        return listed

    async def resource_templates(self, upstreams: Upstreams) -> list[types.ResourceTemplate]:
        listed: list[types.ResourceTemplate] = []
        parsed: list[tuple[UriTemplate, str, str]] = []
        for name, client in upstreams:
            if not offers(client, "resources"):
                continue
            for template in await _all_pages(client, "list_resource_templates", "resource_templates"):
                listed.append(template)
                try:
                    parsed.append((UriTemplate.parse(template.uri_template), template.uri_template, name))
                except Exception:  # a template we cannot read is listed but routes nothing
                    continue
        self.templates = parsed
        return listed

    async def prompts(self, upstreams: Upstreams) -> list[types.Prompt]:
        offered: list[tuple[str, types.Prompt]] = []
        for name, client in upstreams:
            if offers(client, "prompts"):
                offered += [(name, p) for p in await _all_pages(client, "list_prompts", "prompts")]
        counts: dict[str, int] = {}
        for _, prompt in offered:
            counts[prompt.name] = counts.get(prompt.name, 0) + 1
        listed: list[types.Prompt] = []
        routes: dict[str, tuple[str, str]] = {}
        for upstream, prompt in offered:
            served = prompt.name
            if counts[served] > 1:
                served = SHARED_NAME.format(upstream=upstream, name=prompt.name)
            if served in routes:
                continue
            routes[served] = (upstream, prompt.name)
            listed.append(prompt if served == prompt.name else prompt.model_copy(update={"name": served}))
        self.prompt_routes = routes
        return listed

    # --- routing ---------------------------------------------------------------------------------

    async def resource_owner(self, uri: str, upstreams: Upstreams) -> str:
        """The upstream serving `uri`: the one that listed it (listing again if it is new), else the
        first whose template matches it."""
        if uri not in self.resource_routes:
            await self.resources(upstreams)
        if uri in self.resource_routes:
            return self.resource_routes[uri]
        if not self.templates:
            await self.resource_templates(upstreams)
        for template, _, upstream in self.templates:
            if template.match(uri) is not None:
                return upstream
        raise MCPError(RESOURCE_NOT_FOUND, "Resource not found", {"uri": uri})

    async def prompt_owner(self, served: str, upstreams: Upstreams) -> tuple[str, str]:
        if served not in self.prompt_routes:
            await self.prompts(upstreams)
        if served not in self.prompt_routes:
            raise MCPError(types.INVALID_PARAMS, f"Unknown prompt: {served}")
        return self.prompt_routes[served]

    async def template_owner(self, uri_template: str, upstreams: Upstreams) -> str | None:
        if not any(text == uri_template for _, text, _ in self.templates):
            await self.resource_templates(upstreams)
        return next((upstream for _, text, upstream in self.templates if text == uri_template), None)


def duplicate_uris(listings: Sequence[tuple[str, Sequence[str]]]) -> dict[str, list[str]]:
    """URI -> the upstreams listing it, for URIs more than one upstream lists (in policy order)."""
    seen: dict[str, list[str]] = {}
    for upstream, uris in listings:
        for uri in dict.fromkeys(uris):
            seen.setdefault(uri, []).append(upstream)
    return {uri: names for uri, names in seen.items() if len(names) > 1}


async def listed_uris(client: Client) -> list[str]:
    if not offers(client, "resources"):
        return []
    return [r.uri for r in await _all_pages(client, "list_resources", "resources")]
