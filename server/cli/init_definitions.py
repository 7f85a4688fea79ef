"""`policy init` records what each server listed in the ledger of the policy it wrote.

So the first `commitgate serve` of that policy advertises every wrapped tool with its server's own
definition before the server has started (tools/upstream_definitions.py).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import tomllib
from pathlib import Path

from commitgate.server.cli.tool_listing import Listing
from commitgate.server.ledger import default_ledger_url, open_ledger
from commitgate.tools.upstream_definitions import definitions


def record_listings(policy_path: Path, listings: list[Listing]) -> None:
    """Record each reached server's tools under its upstream name; a failure is one line, not fatal."""
    reached = [listing for listing in listings if listing.error is None]
    if not reached:
        return
    try:
        asyncio.run(_record(policy_path, reached))
    except Exception as exc:  # the policy is written; serve lists the tools itself at connect
        print(f"commitgate: the listed tools were not recorded in the ledger: {exc}", file=sys.stderr)


def ledger_url(policy_path: Path) -> str:
    """The policy's ledger, read without loading the policy: the `${NAME}` references init writes for
    secrets are usually not set yet where init runs."""
    url = tomllib.loads(policy_path.read_text(encoding="utf-8")).get("ledger", {}).get("url")
    if not url:
        return default_ledger_url(policy_path)
    expanded = os.path.expandvars(str(url))
    if "${" in expanded:
        raise ValueError(f"its ledger URL refers to an unset variable ({url})")
    return expanded


async def _record(policy_path: Path, listings: list[Listing]) -> None:
    ledger = await open_ledger(ledger_url(policy_path))
    try:
        now = time.time()
        for listing in listings:
            tools = {tool.name: tool for tool in listing.tools}
            await ledger.record_tool_definitions(listing.entry.name, definitions(tools), now)
    finally:
        await ledger.close()
