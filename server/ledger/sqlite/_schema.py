"""The SQLite ledger's schema: migrations, the row shape, and decoding a row into an Operation."""

from __future__ import annotations

import json
import sqlite3
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commitgate.server.ledger import tool_definitions
from commitgate.server.ledger.base import LedgerUnavailable
from commitgate.server.ledger.evidence import SQLITE_MIGRATION
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ApprovalRecord, ErrorRecord, ReconciliationNote
from commitgate.server.model.records import Operation, ToolResult

# What the duplicate lookup's index keeps of a fingerprint (migration 12). A lookup names this very
# expression, else SQLite cannot use the index.
FINGERPRINT_KEY = "substr(fingerprint, 1, 16)"

MIGRATIONS: list[str] = [
    # 1: operations + audit trail
    """
    CREATE TABLE operations (
        operation_id     TEXT PRIMARY KEY,
        principal        TEXT NOT NULL,
        session          TEXT NOT NULL,
        step             TEXT NOT NULL,
        tool             TEXT NOT NULL,
        idempotency_class TEXT NOT NULL,
        fingerprint      TEXT NOT NULL,
        state            TEXT NOT NULL,
        attempts         INTEGER NOT NULL,
        fence            INTEGER NOT NULL,
        arguments        TEXT NOT NULL,
        lease_owner      TEXT,
        lease_expires_at REAL,
        result           TEXT,
        error            TEXT,
        reconciliation   TEXT,
        downstream_ref   TEXT,
        retention        REAL NOT NULL,
        created_at       REAL NOT NULL,
        updated_at       REAL NOT NULL,
        completed_at     REAL,
        expires_at       REAL
    );
    CREATE UNIQUE INDEX operations_key ON operations (principal, session, step);
    CREATE INDEX operations_state ON operations (state, lease_expires_at);
    CREATE INDEX operations_expiry ON operations (expires_at) WHERE expires_at IS NOT NULL;
    CREATE INDEX operations_recent ON operations (principal, created_at);
    CREATE TABLE audit (
        id           INTEGER PRIMARY KEY,
        operation_id TEXT NOT NULL,
        at           REAL NOT NULL,
        event        TEXT NOT NULL,
        from_state   TEXT,
        to_state     TEXT,
        fence        INTEGER NOT NULL,
        actor        TEXT,
        detail       TEXT
    );
    CREATE INDEX audit_operation ON audit (operation_id, id);
    """,
    # 2: downstream_ref was never written
    "ALTER TABLE operations DROP COLUMN downstream_ref",
    # 3: the duplicate lookup (same action under another key) is a range scan of this index. The
    # fingerprint hashes the tool name too, so (principal, fingerprint) already names the action.
    """
    CREATE INDEX operations_duplicates ON operations (principal, fingerprint, session, created_at);
    """,
    # 4: approvals. An operation waiting for a person's decision keeps it in `approval` (JSON);
    # the sweep finds the waits that ran out through the partial index.
    """
    ALTER TABLE operations ADD COLUMN approval TEXT;
    ALTER TABLE operations ADD COLUMN approval_expires_at REAL;
    CREATE INDEX operations_awaiting ON operations (approval_expires_at) WHERE state = 'AWAITING_APPROVAL';
    """,
    # 5: budgets. Each operation of a budgeted tool carries its budget's name and the amount it
    # spends; its scope is its own principal and session. The sum a claim takes is a range scan of
    # this index, which holds every column the sum reads.
    """
    ALTER TABLE operations ADD COLUMN budget TEXT;
    ALTER TABLE operations ADD COLUMN budget_amount REAL;
    CREATE INDEX operations_budget ON operations (budget, principal, session, created_at, state, budget_amount,
        expires_at) WHERE budget IS NOT NULL;
    """,
    # 6: the audit trail clustered by operation: one B-tree instead of a table and an index, so
    # every claim and every outcome writes (and syncs) one page fewer. `id` now numbers an
    # operation's entries in order (the old, global ids keep their order).
    """
    CREATE TABLE audit_by_operation (
        operation_id TEXT NOT NULL,
        id           INTEGER NOT NULL,
        at           REAL NOT NULL,
        event        TEXT NOT NULL,
        from_state   TEXT,
        to_state     TEXT,
        fence        INTEGER NOT NULL,
        actor        TEXT,
        detail       TEXT,
        PRIMARY KEY (operation_id, id)
    ) WITHOUT ROWID;
    INSERT INTO audit_by_operation SELECT operation_id, id, at, event, from_state, to_state, fence, actor, detail
        FROM audit;
    DROP TABLE audit;
    ALTER TABLE audit_by_operation RENAME TO audit;
    """,
    # 7: budgets spend at the take and add exactly. `budget_spent_at` is when an operation spent
    # (taken to run; NULL while it waits for a person or is approved and not yet taken): it places
    # the operation in the window. Existing records spent when they were created, as they counted
    # then. Amounts are whole units plus billionths, two integers whose sums are exact.
    """
    ALTER TABLE operations ADD COLUMN budget_spent_at REAL;
    ALTER TABLE operations ADD COLUMN budget_units INTEGER;
    ALTER TABLE operations ADD COLUMN budget_nanos INTEGER;
    UPDATE operations SET
        budget_spent_at = CASE WHEN state <> 'AWAITING_APPROVAL' THEN created_at END,
        budget_units = CAST(budget_amount AS INTEGER),
        budget_nanos = CAST(round((budget_amount - CAST(budget_amount AS INTEGER)) * 1000000000) AS INTEGER)
        WHERE budget IS NOT NULL;
    DROP INDEX operations_budget;
    ALTER TABLE operations DROP COLUMN budget_amount;
    CREATE INDEX operations_budget ON operations (budget, principal, session, budget_spent_at, state, budget_units,
        budget_nanos, expires_at) WHERE budget IS NOT NULL;
    """,
    # 8: an outcome writes one index page fewer. A record's state was indexed for every row, so an
    # outcome moved its entry from RUNNING to the final state (two pages). Now open records
    # (`expires_at` NULL: not completed) are indexed by state, and completed ones by state in the
    # expiry index that the outcome writes anyway: counts by state read the two, each covering
    # (`operations_open` carries `expires_at`, NULL in all its entries, for that alone).
    """
    DROP INDEX operations_state;
    CREATE INDEX operations_open ON operations (state, lease_expires_at, expires_at) WHERE expires_at IS NULL;
    DROP INDEX operations_expiry;
    CREATE INDEX operations_expiry ON operations (expires_at, state) WHERE expires_at IS NOT NULL;
    """,
    # 9: receipts (signed, chained per writer) and the outbox of notifications (ledger/evidence.py)
    SQLITE_MIGRATION,
    # 10: the latest definition each upstream gave of its tools (server/ledger/tool_definitions.py)
    tool_definitions.SQLITE_MIGRATION,
    # 11: when each attempt was taken and by whom, on the host's monotonic clock (every process
    # sharing the file runs on this host): a status check may conclude "not found" only once the
    # latest attempt can no longer be running. And a FAILED_FINAL that never ran (a denied or
    # expired approval, spent when it was created by migration 7) gives its amount back.
    """
    ALTER TABLE operations ADD COLUMN attempt_owner TEXT;
    ALTER TABLE operations ADD COLUMN attempt_started REAL;
    UPDATE operations SET budget_spent_at = NULL
        WHERE budget IS NOT NULL AND state = 'FAILED_FINAL' AND attempts = 0;
    """,
    # 12: the duplicate lookup's index keys a fingerprint by its first 16 characters (64 bits of a
    # hex SHA-256), not all 64: its entries, inserted at a random place by every claim, were the
    # largest of any index and half of the bytes a claim wrote. Equal prefixes are told apart by the
    # full fingerprint in the row. Built over the rows already there, so earlier operations count.
    f"""
    DROP INDEX IF EXISTS operations_duplicates;
    CREATE INDEX operations_duplicates ON operations (principal, {FINGERPRINT_KEY}, session, created_at);
    """,
]

_COLUMNS = (
    "operation_id, principal, session, step, tool, idempotency_class, fingerprint, state, attempts, fence, "
    "arguments, lease_owner, lease_expires_at, result, error, reconciliation, created_at, "
    "updated_at, completed_at, expires_at, retention, approval"
)
SELECT = f"SELECT {_COLUMNS} FROM operations"
# Positions in a SELECT row that the claim and purge steps read without decoding the row.
TOOL, FINGERPRINT, STATE, EXPIRES_AT = (
    _COLUMNS.split(", ").index(c) for c in ("tool", "fingerprint", "state", "expires_at")
)
INSERT_AWAITING = (
    "INSERT INTO operations (operation_id, principal, session, step, tool, idempotency_class, fingerprint,"
    " state, attempts, fence, arguments, retention, created_at, updated_at, approval, approval_expires_at,"
    " budget, budget_units, budget_nanos)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, 'AWAITING_APPROVAL', 0, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
INSERT = (
    "INSERT INTO operations (operation_id, principal, session, step, tool, idempotency_class, fingerprint,"
    " state, attempts, fence, arguments, lease_owner, lease_expires_at, retention, created_at, updated_at,"
    " budget, budget_units, budget_nanos, budget_spent_at, attempt_owner, attempt_started)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, 'RUNNING', 1, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# INSERT for a claim without a budget (most of them): four parameters fewer per row, so a batched
# statement binds fewer values and holds more rows.
INSERT_UNBUDGETED = (
    "INSERT INTO operations (operation_id, principal, session, step, tool, idempotency_class, fingerprint,"
    " state, attempts, fence, arguments, lease_owner, lease_expires_at, retention, created_at, updated_at,"
    " attempt_owner, attempt_started)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, 'RUNNING', 1, 1, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# Open records (not completed: no retention clock yet) and completed ones, whose clock runs from
# their completion (`State.terminal`). Each kind has its own index of states (migration 8).
OPEN, COMPLETED = "expires_at IS NULL", "expires_at IS NOT NULL"
COUNTS_BY_STATE = (
    f"SELECT state, count(*) FROM operations INDEXED BY operations_open WHERE {OPEN} GROUP BY state"
    f" UNION ALL SELECT state, count(*) FROM operations INDEXED BY operations_expiry WHERE {COMPLETED}"
    " GROUP BY state"
)
# An entry numbered after the operation's last one (a seek on the page the insert writes anyway).
AUDIT = (
    "INSERT INTO audit (operation_id, id, at, event, from_state, to_state, fence, actor, detail)"
    " VALUES (?1, (SELECT coalesce(max(id), 0) + 1 FROM audit WHERE operation_id = ?1), ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
)
# The first entry of an operation just claimed (its id is new: nothing to number after); what
# every such entry says is written here, not bound: three parameters per row instead of eight.
AUDIT_CLAIMED = (
    "INSERT INTO audit (operation_id, id, at, event, from_state, to_state, fence, actor, detail)"
    " VALUES (?, 1, ?, 'claimed', NULL, 'RUNNING', 1, ?, NULL)"
)


def decode(row: Sequence[Any]) -> Operation:
    return Operation(
        operation_id=row[0],
        principal=row[1],
        session=row[2],
        step=row[3],
        tool=row[4],
        idempotency_class=IdempotencyClass(row[5]),
        fingerprint=row[6],
        state=State(row[7]),
        attempts=row[8],
        fence=row[9],
        arguments=json.loads(row[10]),
        lease_owner=row[11],
        lease_expires_at=row[12],
        result=ToolResult.from_json(row[13]) if row[13] else None,
        error=ErrorRecord.from_stored(json.loads(row[14])) if row[14] else None,
        reconciliation=ReconciliationNote.from_stored(json.loads(row[15])) if row[15] else None,
        created_at=row[16],
        updated_at=row[17],
        completed_at=row[18],
        expires_at=row[19],
        retention=row[20],
        approval=ApprovalRecord.from_stored(json.loads(row[21])) if row[21] else None,
        arguments_json=row[10],
    )


def dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), default=str)


def dump_record(record: ErrorRecord | ReconciliationNote | ApprovalRecord | None) -> str | None:
    """An operation's error, reconciliation or approval as the ledger stores it (`decode` reads it back)."""
    return None if record is None else dump(record.stored())


MAGIC = b"SQLite format 3\x00"
OUR_TABLES = frozenset({"schema_version", "operations", "audit"})


def read_only_uri(path: Path) -> str:
    """A URI that opens `path` for reading only: nothing in the file can change through it."""
    return "file:" + urllib.parse.quote(str(path.absolute())) + "?mode=ro"


def foreign(path: Path) -> str | None:
    """Why the file at `path` is not a commitgate ledger, or None (ours, empty or not there yet).

    Read without changing anything: the header, then the table names through a read-only
    connection. A ledger is never made out of another application's database.
    """
    try:
        with path.open("rb") as file:
            header = file.read(len(MAGIC))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    if not header:
        return None  # an empty file: a new ledger
    if header != MAGIC:
        return "it is not a SQLite database"
    try:
        conn = sqlite3.connect(read_only_uri(path), uri=True)
        try:
            names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            version = (
                conn.execute("SELECT max(version) FROM schema_version").fetchone()[0]
                if "schema_version" in names
                else None
            )
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"it cannot be read as a SQLite database ({exc})"
    if not names:
        return None
    if not names >= OUR_TABLES or version is None:
        return "it is another application's SQLite database (it has no commitgate tables)"
    return None


def schema_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def migrate(conn: sqlite3.Connection) -> int:
    """Apply pending migrations inside the writer's transaction (safe with several processes)."""
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    current = row[0] or 0
    if current > len(MIGRATIONS):
        raise LedgerUnavailable(
            f"ledger schema version {current} is newer than this commitgate ({len(MIGRATIONS)}); upgrade commitgate"
        )
    for version in range(current + 1, len(MIGRATIONS) + 1):
        for statement in MIGRATIONS[version - 1].split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    return len(MIGRATIONS)
