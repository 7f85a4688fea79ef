"""Which ledger a command opens, and the one line on stderr that says so."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from commitgate.server.ledger import default_ledger_url
from commitgate.server.policy.masking import mask_url
from commitgate.server.policy.models import Policy


def ledger_choice(given: str | None, policy: Policy, policy_path: Path | str | None) -> tuple[str, str]:
    """The ledger URL and where it comes from: --ledger, the policy's [ledger] url, or its default."""
    if given:
        return given, "from --ledger"
    where = str(Path(policy_path).expanduser().resolve()) if policy_path is not None else None
    if policy.ledger.url:
        return policy.ledger.url, f"[ledger] url of {where or 'the bundled demo policy'}"
    if where is not None:
        return default_ledger_url(where), f"the default ledger of {where}"
    return default_ledger_url(None), "the default ledger of the bundled demo policy"


def say_ledger(url: str, why: str) -> None:
    """One line on stderr (stdout stays for the command's output, or for MCP under stdio)."""
    print(f"commitgate: ledger {mask_url(url)} ({why})", file=sys.stderr, flush=True)


def log_ledger(url: str, why: str) -> None:
    """The same, for `serve`, whose stderr carries JSON log lines: one info record (a client such as
    Claude Desktop shows warnings to its user on every start; this is no problem of theirs)."""
    logging.getLogger("commitgate.ledger").info("ledger %s (%s)", mask_url(url), why)
