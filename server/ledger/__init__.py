"""Ledger backends behind one interface; `open_ledger(url)` picks one by URL scheme."""

from __future__ import annotations

from pathlib import Path

import platformdirs

from commitgate.server.ledger.base import (
    Change,
    Claim,
    ClaimKind,
    ClaimRequest,
    Lease,
    Ledger,
    LedgerUnavailable,
    OperationFilter,
)

__all__ = [
    "Change",
    "Claim",
    "ClaimKind",
    "ClaimRequest",
    "Lease",
    "Ledger",
    "LedgerUnavailable",
    "OperationFilter",
    "default_ledger_url",
    "open_ledger",
]


def default_ledger_url() -> str:
    """A file in the user's state directory (platformdirs), so no configuration is needed."""
    path = Path(platformdirs.user_state_path("commitgate")) / "ledger.db"
    return f"sqlite:///{path}"


async def open_ledger(url: str | None, *, synchronous: str = "FULL", auto_migrate: bool = True) -> Ledger:
    url = url or default_ledger_url()
    if url.startswith("sqlite:///"):
        from commitgate.server.ledger.sqlite import SQLiteLedger, path_from_url

        return await SQLiteLedger.open(path_from_url(url), synchronous=synchronous)
    if url.startswith(("postgresql://", "postgres://")):
        try:
            from commitgate.server.ledger.postgres import PostgresLedger  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise LedgerUnavailable(
                f"the PostgreSQL ledger needs asyncpg: pip install 'commitgate[postgres]' ({exc})"
            ) from exc
        ledger: Ledger = await PostgresLedger.open(url, auto_migrate=auto_migrate)
        return ledger
    raise LedgerUnavailable(
        f"unsupported ledger URL {url!r}: use sqlite:///relative.db, sqlite:////absolute.db or postgresql://..."
    )
