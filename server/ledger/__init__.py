"""Ledger backends behind one interface; `open_ledger(url)` picks one by URL scheme."""

from __future__ import annotations

import hashlib
import re
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
from commitgate.server.ledger.urls import Backend, LedgerURL, check_postgres_url, parse_ledger_url

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
    "default_ledger_name",
    "default_ledger_url",
    "ledger_location",
    "open_ledger",
    "parse_ledger_url",
]


def default_ledger_url(policy_path: Path | str | None = None) -> str:
    """A file in the user's state directory (platformdirs), so no configuration is needed.

    Each policy file gets its own: two policies never share records, so a key one of them used
    cannot collide with the other's tools. The name carries the policy's file name (for people)
    and a hash of its absolute path (for uniqueness). The bundled demo policy keeps `ledger.db`.
    """
    return f"sqlite:///{Path(platformdirs.user_state_path('commitgate')) / default_ledger_name(policy_path)}"


def default_ledger_name(policy_path: Path | str | None) -> str:
    if policy_path is None:
        return "ledger.db"
    absolute = Path(policy_path).expanduser().resolve()
    digest = hashlib.sha256(str(absolute).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", absolute.stem).strip("-")[:40] or "policy"
    return f"ledger-{stem}-{digest}.db"


def ledger_location(url: str | None) -> LedgerURL:
    """Where `url` (else the default ledger) is; LedgerUnavailable saying what is wrong with it."""
    try:
        where = parse_ledger_url(url or default_ledger_url())
        if where.backend is Backend.POSTGRESQL:
            check_postgres_url(where.url)
    except ValueError as exc:
        raise LedgerUnavailable(f"unsupported ledger URL: {exc}") from None
    return where


async def open_ledger(
    url: str | None,
    *,
    synchronous: str = "FULL",
    auto_migrate: bool = True,
    read_only: bool = False,
    durability: str = "full",
    outcome_sync_within: float = 0.05,
) -> Ledger:
    """The ledger at `url`. `read_only`: for commands that only look; nothing is created or migrated,
    and a database that is not a commitgate ledger is reported as such (LedgerUnavailable).
    `durability`: "full" syncs the claim and the outcome; "claim" syncs the claim and leaves the
    outcome to the next group commit, at most `outcome_sync_within` seconds later."""
    where = ledger_location(url)
    if where.backend is Backend.SQLITE:
        from commitgate.server.ledger.sqlite import SQLiteLedger

        if read_only:
            return await SQLiteLedger.open_read_only(where.sqlite_path)
        return await SQLiteLedger.open(
            where.sqlite_path,
            synchronous=synchronous,
            durability=durability,
            outcome_sync_within=outcome_sync_within,
        )
    try:
        from commitgate.server.ledger.postgres import PostgresLedger  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise LedgerUnavailable(
            f"the PostgreSQL ledger needs asyncpg: pip install 'commitgate[postgres]' ({exc})"
        ) from exc
    ledger: Ledger = await PostgresLedger.open(
        where.url, auto_migrate=auto_migrate and not read_only, durability=durability
    )
    return ledger
