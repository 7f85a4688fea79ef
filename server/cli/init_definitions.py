"""`policy init` records what each server listed in the ledger of the policy it wrote.

So the first `commitgate serve` of that policy advertises every wrapped tool with its server's own
definition before the server has started (tools/upstream_definitions.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from commitgate.server.cli.tool_listing import Listing
from commitgate.server.ledger import default_ledger_url, open_ledger
from commitgate.server.policy.loading import load_policy
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


async def _record(policy_path: Path, listings: list[Listing]) -> None:
    policy = load_policy(policy_path)
    ledger = await open_ledger(policy.ledger.url or default_ledger_url(policy_path))
    try:
        now = time.time()
        for listing in listings:
            tools = {tool.name: tool for tool in listing.tools}
            await ledger.record_tool_definitions(listing.entry.name, definitions(tools), now)
    finally:
        await ledger.close()
