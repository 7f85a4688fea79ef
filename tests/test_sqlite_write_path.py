"""What one claim and one outcome cost the SQLite ledger: pages written, statements run.

Each durable commit writes every B-tree page it touched to the WAL and syncs them, and a sync's
cost grows with the pages it carries: these tests count the frames a claim of a new key and its
outcome append to the WAL on a ledger that already holds operations, and the statements a claim
of an unseen key runs, so that the hot path cannot quietly grow. They also check the shortcut a
claim of an unseen key takes against every case where the key turns out to be taken after all.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import TypeVar

import pytest

from commitgate.server.ledger.base import (
    BudgetCheck,
    Claim,
    ClaimKind,
    ClaimRequest,
    DuplicateCheck,
    OverBudget,
    Transition,
)
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.ledger.sqlite._schema import MIGRATIONS, migrate
from commitgate.server.ledger.sqlite._writes import ClaimWrite, OutcomeWrite
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import Operation, ToolResult

T0 = 1_700_000_000.0
RESULT = ToolResult([{"type": "text", "text": '{"refund":"re_1"}'}], {"refund": "re_1"})
T = TypeVar("T")
DETECTION = DuplicateCheck(window_seconds=600.0, any_session=False, reject=True)


def request(step: str, fingerprint: str | None = None, **fields: object) -> ClaimRequest:
    values: dict[str, object] = {
        "principal": "alice",
        "session": "s1",
        "step": step,
        "tool": "refund",
        "idempotency_class": IdempotencyClass.KEY_REQUIRED,
        "fingerprint": fingerprint or f"fp-{step}",
        "arguments_json": '{"amount_cents":500,"order":"A-1"}',
        "owner": "elsewhere:1:aaaa",
        "lease_seconds": 30.0,
        "retention_seconds": 86400.0,
        "duplicates": DETECTION,
    }
    values.update(fields)
    return ClaimRequest(**values)  # type: ignore[arg-type]


def succeeded(op: Operation) -> Transition:
    return Transition(
        State.SUCCEEDED,
        frozenset({State.RUNNING}),
        AuditEvent.SUCCEEDED,
        expect_fence=op.fence,
        result=RESULT,
    )


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A ledger file in WAL mode that never checkpoints: the WAL only grows, frame by frame."""
    connection = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA wal_autocheckpoint = 0")
    connection.execute("PRAGMA synchronous = OFF")  # thousands of commits; frames do not depend on syncs
    connection.execute("BEGIN IMMEDIATE")
    migrate(connection)
    connection.execute("COMMIT")
    yield connection
    connection.close()


def in_transaction(conn: sqlite3.Connection, write: Callable[[sqlite3.Connection], T]) -> T:
    conn.execute("BEGIN IMMEDIATE")
    value = write(conn)
    conn.execute("COMMIT")
    return value


def claimed(conn: sqlite3.Connection, claim_request: ClaimRequest, now: float = T0) -> Claim | OverBudget:
    return in_transaction(conn, ClaimWrite(claim_request, now, absent=True))


def new_claim(conn: sqlite3.Connection, claim_request: ClaimRequest, now: float = T0) -> Claim:
    claim = claimed(conn, claim_request, now)
    assert isinstance(claim, Claim), claim
    return claim


def finished(conn: sqlite3.Connection, op: Operation) -> Operation:
    done = in_transaction(conn, OutcomeWrite(op.operation_id, succeeded(op), T0, op))
    assert isinstance(done, Operation) and done.state is State.SUCCEEDED
    return done


def claim_and_finish(conn: sqlite3.Connection, step: str) -> Operation:
    claim = new_claim(conn, request(step))
    assert claim.kind is ClaimKind.NEW
    return finished(conn, claim.operation)


def wal_frames(conn: sqlite3.Connection, path: Path) -> int:
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    size = path.stat().st_size
    return 0 if size == 0 else (size - 32) // (page_size + 24)  # a 32-byte header, then frames


def test_a_claim_and_its_outcome_write_few_pages(conn: sqlite3.Connection, tmp_path: Path) -> None:
    """On a ledger with thousands of operations (B-trees several levels deep), a new key's claim
    writes the row, its indexes and one audit page: 7 frames; its outcome 5 (when no page splits:
    a split adds a few). The audit trail was a table and an index, one page more for each."""
    wal = tmp_path / "ledger.db-wal"
    for i in range(3000):
        claim_and_finish(conn, f"warm-{i}")
    claims, outcomes = [], []
    for i in range(50):
        before = wal_frames(conn, wal)
        claim = new_claim(conn, request(f"k{i}"))
        middle = wal_frames(conn, wal)
        finished(conn, claim.operation)
        claims.append(middle - before)
        outcomes.append(wal_frames(conn, wal) - middle)
    print(f"frames per claim {sorted(claims)}, per outcome {sorted(outcomes)}")
    # Splitting a full page writes a few more; a commit that splits nothing is the one to count.
    assert min(claims) <= 7, claims
    assert min(outcomes) <= 5, outcomes


def test_a_claim_of_an_unseen_key_does_not_read_the_key_again(conn: sqlite3.Connection) -> None:
    """The read before the transaction found no row: the insert's unique index checks again."""
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    claim = new_claim(conn, request("k1"))
    conn.set_trace_callback(None)
    assert claim.kind is ClaimKind.NEW
    reads_of_the_key = [
        s for s in statements if "WHERE principal = 'alice' AND session = 's1' AND step = 'k1'" in s
    ]
    assert reads_of_the_key == [], reads_of_the_key
    assert sum(s.startswith("INSERT") for s in statements) == 2  # the row and its audit entry


def test_a_key_taken_after_the_read_is_answered_as_a_taken_key(conn: sqlite3.Connection) -> None:
    """Another process claimed the key between this caller's read and its write: the same answer
    as without the shortcut, and nothing written twice."""
    first = claim_and_finish(conn, "k1")
    again = new_claim(conn, request("k1"))
    assert again.kind is ClaimKind.EXISTING and again.operation.operation_id == first.operation_id
    assert new_claim(conn, request("k1", fingerprint="fp-other")).kind is ClaimKind.CONFLICT
    assert conn.execute("SELECT count(*) FROM operations").fetchone()[0] == 1
    assert conn.execute("SELECT count(*) FROM audit WHERE event = 'claimed'").fetchone()[0] == 1


def test_an_unseen_key_still_meets_duplicates_and_budgets(conn: sqlite3.Connection) -> None:
    claim_and_finish(conn, "k1")
    assert new_claim(conn, request("k2", fingerprint="fp-k1"), T0 + 1).kind is ClaimKind.DUPLICATE
    budget = BudgetCheck(
        name="refunds", amount=Decimal(700), limit=Decimal(1000), window_seconds=3600.0, per="principal"
    )
    assert new_claim(conn, request("k3", budget=budget), T0 + 2).kind is ClaimKind.NEW
    over = claimed(conn, request("k4", budget=budget), T0 + 3)
    assert isinstance(over, OverBudget) and over.spent == 700.0
    assert conn.execute("SELECT count(*) FROM operations").fetchone()[0] == 2


@pytest.mark.anyio
async def test_the_audit_trail_of_an_earlier_schema_keeps_its_order(tmp_path: Path) -> None:
    """A ledger of the schema before the audit trail was clustered by operation: every entry is
    kept, in its order, and new entries follow the old ones."""
    path = tmp_path / "ledger.db"
    with sqlite3.connect(path, isolation_level=None) as old:
        old.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for version, migration in enumerate(MIGRATIONS[:5], start=1):
            old.executescript(migration)
            old.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
        ids = ("op_a", "op_b")
        for op_id in ids:
            old.execute(
                "INSERT INTO operations (operation_id, principal, session, step, tool, idempotency_class,"
                " fingerprint, state, attempts, fence, arguments, lease_owner, lease_expires_at, retention,"
                " created_at, updated_at) VALUES (?, 'alice', 's1', ?, 'refund', 'key-required', ?, 'RUNNING',"
                " 1, 1, '{}', 'elsewhere:1:aaaa', ?, 86400, ?, ?)",
                (op_id, op_id, f"fp-{op_id}", T0 + 30, T0, T0),
            )
        for n, (op_id, event) in enumerate(
            [
                ("op_a", "claimed"),
                ("op_b", "claimed"),
                ("op_a", "retry"),
                ("op_b", "retry"),
                ("op_a", "lease_renewed"),
            ]
        ):
            old.execute(
                "INSERT INTO audit (operation_id, at, event, fence) VALUES (?, ?, ?, 1)",
                (op_id, T0 + n, event),
            )
    ledger = await SQLiteLedger.open(path)
    try:
        change = Transition(
            State.SUCCEEDED, frozenset({State.RUNNING}), AuditEvent.SUCCEEDED, expect_fence=1, result=RESULT
        )
        assert await ledger.update("op_a", change, T0 + 10) is not None
        assert [e.event for e in await ledger.history("op_a")] == [
            "claimed",
            "retry",
            "lease_renewed",
            "succeeded",
        ]
        assert [e.event for e in await ledger.history("op_b")] == ["claimed", "retry"]
    finally:
        await ledger.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT max(version) FROM schema_version").fetchone()[0] == len(MIGRATIONS)
        indexes = [row[1] for row in conn.execute("PRAGMA index_list(audit)") if row[3] != "pk"]
        assert indexes == []  # the entries are found by their key alone


def test_the_operations_a_claim_and_its_outcome_hand_back_are_the_ones_written(
    conn: sqlite3.Connection,
) -> None:
    """Both are built on the caller's side, not read back: each field must be what the file holds."""
    from commitgate.server.ledger.sqlite._schema import SELECT, decode

    def stored(operation_id: str) -> Operation:
        return decode(conn.execute(f"{SELECT} WHERE operation_id = ?", (operation_id,)).fetchone())

    claim = new_claim(conn, request("x", arguments={"amount_cents": 500, "order": "A-1"}))
    assert claim.operation == stored(claim.operation.operation_id)
    assert claim.operation.lease_owner == "elsewhere:1:aaaa" and claim.operation.lease_expires_at == T0 + 30
    assert (claim.operation.created_at, claim.operation.retention) == (T0, 86400.0)
    done = finished(conn, claim.operation)
    assert done == stored(done.operation_id)
    assert (done.completed_at, done.expires_at, done.lease_owner) == (T0, T0 + 86400.0, None)


def test_an_outcome_that_carries_a_decision_writes_it(conn: sqlite3.Connection) -> None:
    """The one-statement outcome writes no approval record: a change carrying one takes the full path,
    so what the caller is handed back is what the file holds."""
    import dataclasses

    from commitgate.server.ledger.sqlite._schema import SELECT, decode
    from commitgate.server.model.notes import ApprovalRecord, ApprovalState

    claim = new_claim(conn, request("decided"))
    decision = ApprovalRecord(ApprovalState.APPROVED, by="ops", via="operator", reason="ok", decided_at=T0)
    change = dataclasses.replace(succeeded(claim.operation), approval=decision)
    done = in_transaction(conn, OutcomeWrite(claim.operation.operation_id, change, T0, claim.operation))
    row = conn.execute(f"{SELECT} WHERE operation_id = ?", (claim.operation.operation_id,)).fetchone()
    assert isinstance(done, Operation) and done.approval == decision
    assert decode(row) == done
