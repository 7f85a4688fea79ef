"""Ledger backends behind one interface; `open_ledger(url)` picks one by URL scheme."""

from __future__ import annotations

from pathlib import Path

import platformdirs

from commitgate.server.ledger.base import (
    Claim,
    ClaimKind,
    ClaimRequest,
    Lease,
    Ledger,
    LedgerUnavailable,
    OperationFilter,
    Transition,
)
from commitgate.server.ledger.urls import Backend, LedgerURL, parse_ledger_url

__all__ = [
    "Claim",
    "ClaimKind",
    "ClaimRequest",
    "Lease",
    "Ledger",
    "LedgerURL",
    "LedgerUnavailable",
    "OperationFilter",
    "Transition",
    "default_ledger_url",
    "open_ledger",
    "parse_ledger_url",
]


def default_ledger_url() -> str:
    """A file in the user's state directory (platformdirs), so no configuration is needed."""
    path = Path(platformdirs.user_state_path("commitgate")) / "ledger.db"
    return f"sqlite:///{path}"


async def open_ledger(url: str | None, *, synchronous: str = "FULL", auto_migrate: bool = True) -> Ledger:
    try:
        where = parse_ledger_url(url or default_ledger_url())
    except ValueError as exc:
        raise LedgerUnavailable(f"unsupported ledger URL: {exc}") from None
    if where.backend is Backend.SQLITE:
        from commitgate.server.ledger.sqlite import SQLiteLedger

        return await SQLiteLedger.open(where.sqlite_path, synchronous=synchronous)
    try:
        from commitgate.server.ledger.postgres import PostgresLedger  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise LedgerUnavailable(
            f"the PostgreSQL ledger needs asyncpg: pip install 'commitgate[postgres]' ({exc})"
        ) from exc
    ledger: Ledger = await PostgresLedger.open(where.url, auto_migrate=auto_migrate)
    return ledger
