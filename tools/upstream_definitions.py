"""The upstream tools' definitions the ledger keeps, so a wrapped tool is never a placeholder.

An upstream may take seconds to start (`npx -y` installing it), and an agent that lists the tools
meanwhile keeps what it saw. So the definition each upstream last gave of its tools (title,
description, schemas, annotations, `_meta`) is kept in the ledger (server/ledger/tool_definitions.py):
`policy init` records what it listed, and a serving process records what it lists at each connect
and reconnect when that differs from what is kept. At start, every connection that has not listed
yet is given the kept definitions (`remembered`), so the first `tools/list` already advertises the
real tools; when the upstream then lists the same, clients are told nothing. A tool nobody ever
listed is advertised from the policy alone.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mcp.types as types
import pydantic

from commitgate.server.ledger.base import Ledger, LedgerUnavailable
from commitgate.server.policy.models import Policy
from commitgate.tools.upstream import UpstreamManager, used_upstreams

log = logging.getLogger("commitgate.tools.upstream")


def as_json(tool: types.Tool) -> dict[str, Any]:
    """A tool's definition as the upstream sent it: wire names, `_meta` included."""
    return tool.model_dump(by_alias=True, mode="json", exclude_none=True)


def definitions(tools: dict[str, types.Tool]) -> dict[str, dict[str, Any]]:
    return {name: as_json(tool) for name, tool in tools.items()}


def _tools(kept: dict[str, dict[str, Any]]) -> dict[str, types.Tool]:
    tools = {}
    for name, definition in kept.items():
        try:
            tools[name] = types.Tool.model_validate(definition)
        except pydantic.ValidationError:  # kept by another version: the next listing replaces it
            log.debug("the kept definition of %s does not fit this version; ignored", name)
    return tools


async def remembered(upstreams: UpstreamManager, policy: Policy, ledger: Ledger) -> None:
    """Give each upstream connection of `policy` that has not listed its tools yet the definitions the
    ledger keeps; its sources are then built from them, until the upstream lists its own."""
    names = sorted(used_upstreams(policy))
    if not names:
        return
    try:
        kept = await ledger.tool_definitions(names)
    except LedgerUnavailable as exc:  # the tools are then advertised from the policy until listed
        log.warning("the upstream tools' kept definitions could not be read: %s", exc)
        return
    lookup = upstreams.lookup(policy)
    for name in names:
        connection = lookup(name)
        if connection is not None and not connection.listed and name in kept:
            connection.tools = _tools(kept[name])


async def record_listed(upstreams: UpstreamManager, policy: Policy, ledger: Ledger) -> None:
    """Keep what the ledger holds current: each upstream of `policy` that listed its tools, when its
    listing differs from what is kept (another replica may have recorded it already)."""
    lookup = upstreams.lookup(policy)
    listed = {
        name: definitions(connection.tools)
        for name in sorted(used_upstreams(policy))
        if (connection := lookup(name)) is not None and connection.listed
    }
    if not listed:
        return
    try:
        kept = await ledger.tool_definitions(sorted(listed))
        for name, tools in listed.items():
            if kept.get(name, {}) != tools:
                await ledger.record_tool_definitions(name, tools, time.time())
    except LedgerUnavailable as exc:  # the next connect records them
        log.warning("the upstream tools' definitions could not be recorded: %s", exc)
