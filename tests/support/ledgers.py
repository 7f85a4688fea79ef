"""The ledger backends the contract suite runs on: one `ledger` fixture, parametrized over them.

Add a backend by naming it in BACKENDS and opening it in `backend`; every
test that asks for the `ledger` fixture (conftest.py) then runs on it too.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from commitgate.server.ledger.base import Ledger
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import State

# The audit event the boundary records with each outcome, for tests that write outcomes directly.
OUTCOME_EVENTS: dict[State, AuditEvent] = {
    State.SUCCEEDED: AuditEvent.SUCCEEDED,
    State.FAILED_FINAL: AuditEvent.FAILED_FINAL,
    State.FAILED_RETRYABLE: AuditEvent.RETRIES_EXHAUSTED,
    State.UNKNOWN: AuditEvent.AMBIGUOUS,
    State.COMPENSATED: AuditEvent.COMPENSATED,
}

BACKENDS: list[str] = ["sqlite", "postgres"]


@asynccontextmanager
async def backend(name: str, tmp_path: Path) -> AsyncIterator[Ledger]:
    """A fresh, empty ledger of backend `name`, private to one test, closed after it."""
    if name == "sqlite":
        sqlite = await SQLiteLedger.open(tmp_path / "ledger.db")
        try:
            yield sqlite
        finally:
            await sqlite.close()
    elif name == "postgres":  # skips (fails under CI=true) without PostgreSQL
        from support.postgres import private_ledger

        async with private_ledger() as ledger:
            yield ledger
    else:
        raise ValueError(f"unknown ledger backend {name!r}; known: {', '.join(BACKENDS)}")


def sqlite_back_to_version_7(conn: sqlite3.Connection) -> None:
    """A SQLite ledger's state indexes as version 7 had them: one index of every record's state, and
    an expiry index without states (a test then takes the ledger further back, or opens it)."""
    conn.execute("DROP INDEX operations_open")
    conn.execute("CREATE INDEX operations_state ON operations (state, lease_expires_at)")
    conn.execute("DROP INDEX operations_expiry")
    conn.execute("CREATE INDEX operations_expiry ON operations (expires_at) WHERE expires_at IS NOT NULL")
    for column in ("attempt_owner", "attempt_started"):  # kept from a later version: dropped with it
        conn.execute(f"ALTER TABLE operations DROP COLUMN {column}")
    conn.execute("DELETE FROM schema_version WHERE version > 7")
