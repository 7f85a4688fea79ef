"""Group commit in the SQLite ledger: batched claims and outcomes decide exactly as one by one.

A batch of the writer thread runs consecutive claims (and plain outcomes) with one statement per
table; whenever that cannot give each write its own answer (a key taken, repeated or expired, a
fenced-out outcome) the batch must fall back to the write-by-write path and keep nothing of the
shortcut. Each test runs the same writes both ways on real ledger files and compares the rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.ledgers import OUTCOME_EVENTS

from commitgate.server.ledger.base import Claim, ClaimKind, ClaimRequest, DuplicateCheck, Lease, Transition
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.ledger.sqlite._writes import ClaimWrite, OutcomeWrite, run_writes
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ErrorRecord
from commitgate.server.model.records import Operation, ToolResult

T0 = 1_700_000_000.0
OWNER = "elsewhere:1:aaaa"
RESULT = ToolResult([{"type": "text", "text": '{"ok":true}'}], {"ok": True})


def claim(step: str, fingerprint: str = "fp", retention: float = 100.0) -> ClaimRequest:
    return ClaimRequest(
        "alice",
        "s1",
        step,
        "charge",
        IdempotencyClass.KEY_REQUIRED,
        fingerprint,
        '{"amount":5}',
        OWNER,
        10.0,
        retention,
    )


def outcome(fence: int = 1, state: State = State.SUCCEEDED) -> Transition:
    error = None if state is State.SUCCEEDED else ErrorRecord(outcome="permanent", message="declined")
    result = RESULT if state is State.SUCCEEDED else None
    return Transition(
        state,
        frozenset({State.RUNNING}),
        OUTCOME_EVENTS[state],
        expect_fence=fence,
        result=result,
        error=error,
    )


@pytest.fixture
async def ledgers(tmp_path: Path) -> AsyncIterator[tuple[SQLiteLedger, SQLiteLedger]]:
    """Two empty ledgers: one for the batched path, one for the write-by-write reference."""
    batched = await SQLiteLedger.open(tmp_path / "batched.db")
    reference = await SQLiteLedger.open(tmp_path / "reference.db")
    yield batched, reference
    await batched.close()
    await reference.close()


def in_one_batch(ledger: SQLiteLedger, writes: Sequence[Any]) -> list[Any]:
    """What the writer thread does with one batch: every write in one transaction."""
    writer = ledger._writer
    with writer._lock:
        outcomes = writer._together(list(writes))
    assert outcomes is not None
    return [value for _, value in outcomes]


def one_by_one(ledger: SQLiteLedger, writes: Sequence[Any]) -> list[Any]:
    writer = ledger._writer
    with writer._lock:
        return [writer._together([write])[0][1] for write in writes]  # type: ignore[index]


def rows(ledger: SQLiteLedger) -> list[tuple[Any, ...]]:
    """Everything but ids: (key, state, attempts, fence, result, error, lease owner) and the audit trail."""
    with sqlite3.connect(ledger.path) as conn:
        ops = conn.execute(
            "SELECT step, state, attempts, fence, result, error, lease_owner, completed_at, expires_at"
            " FROM operations ORDER BY step"
        ).fetchall()
        audit = conn.execute(
            "SELECT o.step, a.event, a.from_state, a.to_state, a.fence FROM audit a"
            " JOIN operations o USING (operation_id) ORDER BY o.step, a.id"
        ).fetchall()
    return ops + audit


@contextlib.contextmanager
def no_single_writes(monkeypatch: pytest.MonkeyPatch, kind: type) -> Iterator[None]:
    """Within: a write of `kind` run on its own fails the test (the batch must take the shortcut)."""

    def single(self: Any, conn: sqlite3.Connection) -> Any:
        raise AssertionError(f"{kind.__name__} ran on its own instead of in the batch")

    with monkeypatch.context() as patch:
        patch.setattr(kind, "__call__", single)
        yield


@contextlib.contextmanager
def statements_run(ledger: SQLiteLedger) -> Iterator[list[str]]:
    """Within: every statement the writer thread's connection runs, as SQLite reports it."""
    statements: list[str] = []
    ledger._writer._conn.set_trace_callback(statements.append)
    try:
        yield statements
    finally:
        ledger._writer._conn.set_trace_callback(None)


def kinds(claims: Sequence[Claim]) -> list[ClaimKind]:
    return [c.kind for c in claims]


@pytest.mark.anyio
async def test_new_keys_are_claimed_together_as_one_by_one(
    ledgers: tuple[SQLiteLedger, SQLiteLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    batched, reference = ledgers
    writes = [claim(f"k{i}") for i in range(20)]
    with no_single_writes(monkeypatch, ClaimWrite):
        together = in_one_batch(batched, [ClaimWrite(r, T0) for r in writes])
    alone = one_by_one(reference, [ClaimWrite(r, T0) for r in writes])
    assert kinds(together) == kinds(alone) == [ClaimKind.NEW] * 20
    assert rows(batched) == rows(reference)
    assert [c.operation.step for c in together] == [r.step for r in writes]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "case",
    ["repeated in the batch", "already claimed", "claimed with other arguments", "past retention"],
)
async def test_a_batch_that_cannot_be_claimed_together_decides_step_by_step(
    ledgers: tuple[SQLiteLedger, SQLiteLedger], case: str
) -> None:
    batched, reference = ledgers
    earlier = {
        "repeated in the batch": [],
        "already claimed": [claim("k2")],
        "claimed with other arguments": [claim("k2", fingerprint="other")],
        "past retention": [claim("k2", retention=1.0)],
    }[case]
    writes = [claim("k1"), claim("k2"), claim("k3")] + (
        [claim("k2")] if case == "repeated in the batch" else []
    )
    for ledger in (batched, reference):
        for first in one_by_one(ledger, [ClaimWrite(r, T0 - 50) for r in earlier]):  # then completed
            one_by_one(ledger, [OutcomeWrite(first.operation.operation_id, outcome(), T0 - 49)])
    together = in_one_batch(batched, [ClaimWrite(r, T0) for r in writes])
    alone = one_by_one(reference, [ClaimWrite(r, T0) for r in writes])
    assert kinds(together) == kinds(alone)
    assert kinds(together).count(ClaimKind.NEW) == len({r.step for r in writes}) - (
        1 if case in ("already claimed", "claimed with other arguments") else 0
    )
    assert rows(batched) == rows(reference)  # nothing of the abandoned shortcut is left behind


def same(op: Operation | None) -> dict[str, Any] | None:
    """Everything an answer says about an operation but its id (two ledgers never share ids)."""
    if op is None:
        return None
    return {k: v for k, v in dataclasses.asdict(op).items() if k != "operation_id"}


@pytest.mark.anyio
@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("known", [False, True], ids=["read back", "caller's operation"])
async def test_outcomes_are_recorded_together_unless_one_is_fenced_out(
    ledgers: tuple[SQLiteLedger, SQLiteLedger], stale: bool, known: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    batched, reference = ledgers
    results: dict[str, list[Any]] = {}
    for name, ledger in (("batched", batched), ("reference", reference)):
        claims = one_by_one(ledger, [ClaimWrite(claim(f"k{i}"), T0) for i in range(6)])
        changes = [outcome(state=State.FAILED_FINAL if i == 3 else State.SUCCEEDED) for i in range(6)]
        if stale:
            changes[4] = outcome(fence=7)  # an owner whose attempt was superseded
        if name == "reference":  # the write-by-write path, reading every operation
            writes = [
                OutcomeWrite(c.operation.operation_id, ch, T0 + 1)
                for c, ch in zip(claims, changes, strict=True)
            ]
            results[name] = one_by_one(ledger, writes)
            continue
        writes = [
            OutcomeWrite(c.operation.operation_id, ch, T0 + 1, c.operation if known else None)
            for c, ch in zip(claims, changes, strict=True)
        ]
        with contextlib.nullcontext() if stale else no_single_writes(monkeypatch, OutcomeWrite):
            results[name] = in_one_batch(ledger, writes)
    together, alone = results["batched"], results["reference"]
    assert [same(op) for op in together] == [same(op) for op in alone]
    assert (together[4] is None) is stale
    assert rows(batched) == rows(reference)


@pytest.mark.anyio
async def test_an_outcome_from_a_superseded_attempt_writes_nothing_even_without_a_read(
    ledgers: tuple[SQLiteLedger, SQLiteLedger],
) -> None:
    """The caller holds the operation at fence 1, but a newer attempt took it meanwhile (fence 2)."""
    ledger, _ = ledgers
    first = one_by_one(ledger, [ClaimWrite(claim("k1"), T0)])[0].operation
    retry = Transition(
        State.RUNNING,
        frozenset({State.RUNNING}),
        AuditEvent.RETRY,
        expect_fence=1,
        lease=Lease(OWNER, T0 + 60),
    )
    assert one_by_one(ledger, [OutcomeWrite(first.operation_id, retry, T0 + 1)])[0].fence == 2
    before = rows(ledger)
    late = OutcomeWrite(first.operation_id, outcome(fence=1), T0 + 2, first)
    assert late.current is first  # the shortcut is taken...
    assert one_by_one(ledger, [late]) == [None]  # ...and finds nothing to write
    assert rows(ledger) == before


@pytest.mark.anyio
async def test_only_plain_outcomes_take_the_shortcut() -> None:
    plain = OutcomeWrite("op", outcome(), T0)
    unfenced = OutcomeWrite(
        "op", Transition(State.SUCCEEDED, frozenset({State.RUNNING}), AuditEvent.SUCCEEDED), T0
    )
    reconciled = OutcomeWrite(
        "op",
        Transition(State.SUCCEEDED, frozenset({State.UNKNOWN}), AuditEvent.RECONCILED_FOUND, result=RESULT),
        T0,
    )
    assert plain.plain_outcome
    assert not unfenced.plain_outcome and not reconciled.plain_outcome


def test_runs_of_one_kind_are_grouped_in_order(tmp_path: Path) -> None:
    seen: list[str] = []

    def other(conn: sqlite3.Connection) -> str:
        seen.append("other")
        return "other"

    class Kind:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, conn: sqlite3.Connection) -> str:
            seen.append(self.name)
            return self.name

        @staticmethod
        def run_many(conn: sqlite3.Connection, writes: Sequence[Kind]) -> list[str]:
            seen.append("many:" + ",".join(s.name for s in writes))
            return [s.name for s in writes]

    with sqlite3.connect(tmp_path / "x.db") as conn:
        values = run_writes(conn, [Kind("a"), Kind("b"), other, Kind("c"), Kind("d"), Kind("e")])
    assert values == ["a", "b", "other", "c", "d", "e"]
    assert seen == ["many:a,b", "other", "many:c,d,e"]


@pytest.mark.anyio
async def test_the_wal_is_copied_back_off_the_commit_path(tmp_path: Path) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    try:
        empty = (tmp_path / "ledger.db").stat().st_size
        for i in range(200):
            new = await ledger.claim(claim(f"k{i}"), T0)
            assert await ledger.update(new.operation.operation_id, outcome(), T0 + 1) is not None
        deadline = time.monotonic() + 10
        while (tmp_path / "ledger.db").stat().st_size <= empty and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        assert (tmp_path / "ledger.db").stat().st_size > empty  # the checkpointer copied pages back
        with sqlite3.connect(tmp_path / "ledger.db") as conn:
            assert (
                conn.execute("SELECT count(*) FROM operations WHERE state = 'SUCCEEDED'").fetchone()[0] == 200
            )
            assert ledger._writer._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] > 1000
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_the_checkpointer_leaves_an_idle_ledger_alone(tmp_path: Path) -> None:
    """It checkpoints only when this process committed since its last complete checkpoint: an idle
    server neither runs statements every quarter second nor takes the write lock for them."""
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    statements: list[str] = []
    checkpointer = ledger._writer._checkpointer
    try:
        await ledger.claim(claim("k1"), T0)
        await anyio.sleep(0.6)  # two ticks: the claim is copied back
        checkpointer._conn.set_trace_callback(statements.append)
        await anyio.sleep(0.6)
        assert statements == []
        await ledger.claim(claim("k2"), T0)
        deadline = time.monotonic() + 5
        while not statements and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        assert any("wal_checkpoint" in sql for sql in statements), statements
    finally:
        checkpointer._conn.set_trace_callback(None)
        await ledger.close()


def _wal_restarts(wal: Path) -> int:
    """The WAL header's checkpoint sequence number: +1 each time writers start the WAL over."""
    with wal.open("rb") as file:
        return int.from_bytes(file.read(16)[12:16], "big")


@pytest.mark.anyio
async def test_a_steady_stream_of_commits_still_starts_the_wal_over(tmp_path: Path) -> None:
    """A checkpoint races the commits made while it copies; unless it wins, the WAL only grows
    (to the 80 MB backstop) and every commit appends, which makes each sync dearer."""
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    try:
        await ledger.claim(claim("first"), T0)
        first = _wal_restarts(tmp_path / "ledger.db-wal")
        deadline = time.monotonic() + 1.5  # six checkpoints
        i = 0
        while time.monotonic() < deadline:  # back to back: no quiet moment for a checkpoint to win
            new = await ledger.claim(claim(f"k{i}"), T0)
            assert await ledger.update(new.operation.operation_id, outcome(), T0 + 1) is not None
            i += 1
        assert _wal_restarts(tmp_path / "ledger.db-wal") - first >= 2
        with sqlite3.connect(tmp_path / "ledger.db") as conn:
            assert (
                conn.execute("SELECT count(*) FROM operations WHERE state = 'SUCCEEDED'").fetchone()[0] == i
            )
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_a_batch_runs_a_few_statements_however_many_writes_it_holds(
    ledgers: tuple[SQLiteLedger, SQLiteLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer thread must win the GIL back after every statement it runs, and under load the
    event loop holds it for most of its turn: a batch pays per statement, not per row. 300 claims
    and 300 outcomes (more than one statement's share of rows each) still decide as one by one."""
    batched, reference = ledgers
    count = 300
    with no_single_writes(monkeypatch, ClaimWrite):
        claims = in_one_batch(batched, [ClaimWrite(claim(f"k{i:03}"), T0) for i in range(count)])
    reference_claims = one_by_one(reference, [ClaimWrite(claim(f"k{i:03}"), T0) for i in range(count)])
    with statements_run(batched) as statements, no_single_writes(monkeypatch, OutcomeWrite):
        done = in_one_batch(
            batched, [OutcomeWrite(c.operation.operation_id, outcome(), T0 + 1) for c in claims]
        )
    one_by_one(
        reference, [OutcomeWrite(c.operation.operation_id, outcome(), T0 + 1) for c in reference_claims]
    )
    assert all(op is not None and op.state is State.SUCCEEDED for op in done)
    assert rows(batched) == rows(reference)  # each audit entry numbered after its operation's claim
    # BEGIN, a savepoint, 3 chunks each of updates and of audit entries, the read back, RELEASE, COMMIT
    assert len(statements) <= 12, statements


@pytest.mark.anyio
async def test_statement_journals_of_a_batch_stay_in_memory(
    ledgers: tuple[SQLiteLedger, SQLiteLedger],
) -> None:
    """A statement inside a transaction keeps the pages it changes in a statement journal, which
    SQLite spills to a new temporary file past 64 KiB: a group commit of tens of writes did so,
    opening, writing and deleting a file per batch. In memory it is a copy of a few pages."""
    ledger, _ = ledgers
    writer = ledger._writer
    for conn in (writer._conn, writer._inline):
        assert conn.execute("PRAGMA temp_store").fetchone()[0] == 2  # MEMORY


def detecting(step: str, fingerprint: str, session: str = "s1", any_session: bool = False) -> ClaimRequest:
    return dataclasses.replace(
        claim(step, fingerprint),
        session=session,
        duplicates=DuplicateCheck(window_seconds=60.0, any_session=any_session, reject=True),
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("case", "shortcut"),
    [
        ("no earlier action", True),
        ("the same action earlier in the session", False),
        ("the same action in another session, principal scope", False),
        ("the same action in another session, session scope", True),
        ("the same action before the window", True),
        ("the same action, failed for good", True),
    ],
)
async def test_a_batch_of_detecting_claims_looks_for_duplicates_in_one_statement(
    ledgers: tuple[SQLiteLedger, SQLiteLedger], monkeypatch: pytest.MonkeyPatch, case: str, shortcut: bool
) -> None:
    """The batch asks once whether any of its claims repeats an action; when one does, every claim
    is decided on its own, exactly as one by one (the repeated one answers DUPLICATE)."""
    batched, reference = ledgers
    any_session = "principal scope" in case
    earlier_session = "s2" if "another session" in case else "s1"
    earlier_at = T0 - 120 if "before the window" in case else T0 - 5
    final = State.FAILED_FINAL if "failed for good" in case else State.SUCCEEDED
    for ledger in (batched, reference):
        if case != "no earlier action":
            first = one_by_one(ledger, [ClaimWrite(detecting("old", "fp-2", earlier_session), earlier_at)])[0]
            one_by_one(ledger, [OutcomeWrite(first.operation.operation_id, outcome(state=final), earlier_at)])
    writes = [detecting(f"k{i}", f"fp-{i}", any_session=any_session) for i in range(5)]
    single_writes = contextlib.nullcontext() if not shortcut else no_single_writes(monkeypatch, ClaimWrite)
    with statements_run(batched) as statements, single_writes:
        together = in_one_batch(batched, [ClaimWrite(r, T0) for r in writes])
    alone = one_by_one(reference, [ClaimWrite(r, T0) for r in writes])
    assert kinds(together) == kinds(alone)
    assert (ClaimKind.DUPLICATE in kinds(together)) is not shortcut
    if shortcut:  # BEGIN, a savepoint, the lookup, the rows, their audit entries, RELEASE, COMMIT
        assert len(statements) == 7, statements
    assert rows(batched) == rows(reference)
