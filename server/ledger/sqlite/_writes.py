"""Ledger writes: what one claim or one outcome does to the database, alone or in a batch.

Each write is a callable run on a connection inside a transaction the writer opened. Runs of
consecutive claims of new keys, or of plain outcomes, go together (`run_many`); anything else
runs write by write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from decimal import Decimal
from typing import Any

from commitgate.server.ledger.base import (
    BUDGET_STATES,
    DUPLICATE_STATES,
    LEASE_LOST,
    BudgetCheck,
    Claim,
    ClaimKind,
    ClaimRequest,
    Lease,
    OverBudget,
    Transition,
    lease_over,
    over_budget_wait,
    scope_of,
    sql_state,
    sql_states,
)
from commitgate.server.ledger.sqlite._ids import new_operation_id
from commitgate.server.ledger.sqlite._schema import (
    AUDIT,
    AUDIT_CLAIMED,
    EXPIRES_AT,
    FINGERPRINT_KEY,
    INSERT,
    INSERT_AWAITING,
    INSERT_UNBUDGETED,
    SELECT,
    decode,
    dump,
    dump_record,
)
from commitgate.server.model.amounts import joined, split
from commitgate.server.model.audit import AuditEvent, recorded_actor
from commitgate.server.model.facts import State
from commitgate.server.model.records import Operation

_RUNNING = sql_state(State.RUNNING)  # the state an attempt holds, as SQL


def _audit(
    conn: sqlite3.Connection,
    operation_id: str,
    now: float,
    event: AuditEvent,
    from_state: str | None,
    to_state: str | None,
    fence: int,
    actor: str | None = None,
    detail: Mapping[str, Any] | None = None,
) -> None:
    conn.execute(AUDIT, (operation_id, now, event, from_state, to_state, fence, actor, dump(detail)))


def to_unknown(conn: sqlite3.Connection, op: Operation, now: float) -> None:
    conn.execute(
        f"UPDATE operations SET state = {sql_state(State.UNKNOWN)}, lease_owner = NULL, lease_expires_at = NULL,"
        f" updated_at = ?, error = ? WHERE operation_id = ? AND fence = ? AND state = {_RUNNING}",
        (now, dump_record(LEASE_LOST), op.operation_id, op.fence),
    )
    _audit(conn, op.operation_id, now, AuditEvent.LEASE_EXPIRED, "RUNNING", "UNKNOWN", op.fence, detail=None)
    op.state, op.lease_owner, op.lease_expires_at, op.updated_at = State.UNKNOWN, None, None, now
    op.error = LEASE_LOST


# States a claim can be answered from without writing anything (see `SQLiteLedger._settled`).
SETTLED = frozenset({State.SUCCEEDED.value, State.FAILED_FINAL.value, State.COMPENSATED.value})


_UNLESS_TAKEN = " ON CONFLICT (principal, session, step) DO NOTHING"


class ClaimWrite:
    """Claim one key. In a group commit, consecutive claims of new keys run as one statement each
    for the rows and their audit entries (`run_many`); anything unusual runs write by write."""

    __slots__ = ("absent", "needs_precheck", "new", "now", "request")

    def __init__(self, request: ClaimRequest, now: float, absent: bool = False, checked: bool = True) -> None:
        """`absent`: a read just before found no row under the key, so most likely there is none.
        `checked`: the caller made sure the ledger file is still the one at its path; if not, the
        writer does before the batch that writes this claim (`Writer.precheck`)."""
        self.request, self.now, self.absent = request, now, absent
        self.needs_precheck = not checked
        # Built here, on the caller's thread: the writer thread is the ledger's one serial path,
        # and what it need not do in Python shortens every group commit.
        self.new = _new_operation(request, now)

    def __call__(self, conn: sqlite3.Connection) -> Claim | OverBudget:
        if self.absent and self.request.approval is None:
            claimed = _claim_unseen(conn, self.request, self.now, self.new)
            if claimed is not None:
                return claimed
        return _claim(conn, self.request, self.now, self.new)

    @staticmethod
    def run_many(conn: sqlite3.Connection, writes: Sequence[ClaimWrite]) -> list[Claim] | None:
        """All new, distinct keys: claimed together. Otherwise (a key taken, past retention, or
        repeated in the batch, or a budget that not all of them fit) nothing of it is kept and None
        says: run them one by one."""
        if len({(s.request.principal, s.request.session, s.request.step) for s in writes}) != len(writes):
            return None
        if any(s.request.approval is not None for s in writes):
            return None
        if not _no_duplicates(conn, writes) or not _budgets_fit(conn, writes):
            return None
        ops = [s.new for s in writes]
        budgeted = any(s.request.budget is not None for s in writes)
        insert, row = (INSERT, _insert_row) if budgeted else (INSERT_UNBUDGETED, _unbudgeted_row)
        with _savepoint(conn) as undo:
            rows = [row(op, s.request) for op, s in zip(ops, writes, strict=True)]
            if insert_rows(conn, insert, rows, _UNLESS_TAKEN) != len(rows):
                undo()
                return None
            insert_rows(conn, AUDIT_CLAIMED, [_claimed_row(op) for op in ops])
        return [Claim(ClaimKind.NEW, op) for op in ops]


_RUNNING_ONLY = frozenset({State.RUNNING})

# A plain outcome: RUNNING to a final state, at the fence the recording attempt holds.
# Its parameters: the new state, result and error, the time, the operation and its fence.
_PLAIN_OUTCOME = (
    "UPDATE operations SET state = ?1, result = COALESCE(?2, result), error = ?3, lease_owner = NULL,"
    " lease_expires_at = NULL, updated_at = ?4, completed_at = ?4, expires_at = ?4 + retention"
    f" WHERE operation_id = ?5 AND fence = ?6 AND state = {_RUNNING}"
)


# The same for many operations in one statement (see `rows_statement`): v.column1..6 are a row's
# values in `_PLAIN_OUTCOME`'s order; the primary key finds each operation.
_PLAIN_OUTCOMES = (
    "UPDATE operations SET state = v.column1, result = COALESCE(v.column2, result), error = v.column3,"
    " lease_owner = NULL, lease_expires_at = NULL, updated_at = v.column4, completed_at = v.column4,"
    " expires_at = v.column4 + retention FROM ({values}) AS v"
    f" WHERE operations.operation_id = v.column5 AND operations.fence = v.column6 AND state = {_RUNNING}"
)
# AUDIT for many operations, each distinct: every entry numbered after its operation's last one.
_AUDITS = (
    "INSERT INTO audit (operation_id, id, at, event, from_state, to_state, fence, actor, detail)"
    " SELECT v.column1, (SELECT coalesce(max(id), 0) + 1 FROM audit WHERE operation_id = v.column1),"
    " v.column2, v.column3, v.column4, v.column5, v.column6, v.column7, v.column8 FROM ({values}) AS v"
)


class OutcomeWrite:
    """Apply one change (`_apply`). A plain outcome (RUNNING to a final state, fenced, no lease)
    of an operation the caller holds at that fence is written without reading it first; in a
    group commit, consecutive plain outcomes are written with one update and one audit insert
    (and one read, unless every caller held its operation)."""

    __slots__ = (
        "after",
        "audit_row",
        "change",
        "current",
        "lazy",
        "now",
        "operation_id",
        "plain_outcome",
        "row",
    )

    def __init__(
        self, operation_id: str, change: Transition, now: float, current: Operation | None = None
    ) -> None:
        self.operation_id, self.change, self.now = operation_id, change, now
        self.lazy = False  # may commit without a sync of its own (durability "claim")
        self.plain_outcome = plain = _is_plain_outcome(change)
        # The operation as the caller holds it at the change's fence: a plain outcome then needs no read.
        known = current if plain and current is not None and current.fence == change.expect_fence else None
        self.current = known
        # The rows and the operation after the change, built here rather than on the writer thread.
        self.row, self.audit_row = _outcome_rows(operation_id, change, now)
        self.after = _outcome(known, change, now) if known is not None else None

    def __call__(self, conn: sqlite3.Connection) -> Operation | OverBudget | None:
        if self.current is None:
            return _apply(conn, self.operation_id, self.change, self.now)
        # The WHERE clause makes exactly `_apply`'s checks for such a change; whatever else may
        # have moved meanwhile (a lease renewal) the outcome overwrites anyway.
        if conn.execute(_PLAIN_OUTCOME, self.row).rowcount != 1:
            return None
        conn.execute(AUDIT, self.audit_row)
        return self.after

    @staticmethod
    def run_many(conn: sqlite3.Connection, writes: Sequence[OutcomeWrite]) -> list[Operation | None] | None:
        """What `_apply` would do to each, if every one applies; otherwise None and nothing kept."""
        ids = [s.operation_id for s in writes]
        if len(set(ids)) != len(ids) or not all(s.plain_outcome for s in writes):
            return None
        with _savepoint(conn) as undo:
            if rows_statement(conn, _PLAIN_OUTCOMES, [s.row for s in writes]) != len(writes):
                undo()  # one was fenced out or moved on: decide each on its own
                return None
            rows_statement(conn, _AUDITS, [s.audit_row for s in writes])
            if all(s.after is not None for s in writes):
                return [s.after for s in writes if s.after is not None]
            rows = {row[0]: row for chunk in _chunks([(i,) for i in ids]) for row in _read_ids(conn, chunk)}
        return [decode(rows[operation_id]) for operation_id in ids]


def _is_plain_outcome(change: Transition) -> bool:
    """RUNNING to a final state, fenced, taking no lease: what `OutcomeWrite.run_many` writes in one statement."""
    return (
        change.expect_fence is not None
        and change.lease is None
        and change.reconciliation is None
        and change.approval is None  # a decision's record is written by `_apply`, not by the one statement
        and change.expect_states == _RUNNING_ONLY
        and change.to_state.terminal
        and (change.error is not None or change.to_state is State.SUCCEEDED)
    )


def _outcome_rows(
    operation_id: str, change: Transition, now: float
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """`_PLAIN_OUTCOME`'s parameters and `AUDIT`'s for such a change. (Absent values are tested here,
    not in a call each: these run for every outcome.)"""
    state, fence, result, error, actor, detail = (
        change.to_state.value, change.expect_fence, change.result, change.error, change.actor, change.detail
    )  # fmt: skip
    row = (state, None if result is None else result.to_json(), None if error is None else dump_record(error),
           now, operation_id, fence)  # fmt: skip
    audit = (operation_id, now, change.event, "RUNNING", state, fence,
             None if actor is None else recorded_actor(actor), None if detail is None else dump(detail))  # fmt: skip
    return row, audit


@contextlib.contextmanager
def _savepoint(conn: sqlite3.Connection) -> Iterator[Callable[[], None]]:
    """A savepoint around a batched write; the body calls `undo()` to drop what it wrote."""

    def undo() -> None:
        conn.execute("ROLLBACK TO batched")

    conn.execute("SAVEPOINT batched")
    try:
        yield undo
    finally:
        conn.execute("RELEASE batched")


# Parameters per statement: SQLite before 3.32 allows 999 (later ones 32,766).
_MAX_PARAMETERS = 999


def rows_statement(conn: sqlite3.Connection, template: str, rows: Sequence[tuple[Any, ...]]) -> int:
    """Run `template` for many rows at once, its `{values}` a VALUES list of them; the rows it changed.

    One statement per chunk of rows, not executemany's one step per row: the writer thread gives up the
    GIL while SQLite works and must win it back after every step, and under load the event loop
    holds it for most of its turn, so each step waited for the loop. (The rows have one width.)"""
    return _chunked(conn, rows, lambda count: _values_sql(template, count, len(rows[0])))


def insert_rows(
    conn: sqlite3.Connection, insert: str, rows: Sequence[tuple[Any, ...]], tail: str = ""
) -> int:
    """`insert`, an INSERT of one row (`... VALUES (...)`), for many rows as `rows_statement` runs them."""
    return _chunked(conn, rows, lambda count: _repeated_sql(insert, count, tail))


def _chunked(conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]], sql_for: Callable[[int], str]) -> int:
    return sum(conn.execute(sql_for(len(chunk)), _flat(chunk)).rowcount for chunk in _chunks(rows))


def _chunks(rows: Sequence[tuple[Any, ...]]) -> Iterator[Sequence[tuple[Any, ...]]]:
    """As many rows per chunk as fit in one statement's parameters (the rows have one width)."""
    size = max(1, _MAX_PARAMETERS // len(rows[0])) if rows else 1
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def _read_ids(conn: sqlite3.Connection, ids: Sequence[tuple[str]]) -> list[Any]:
    marks = ",".join("?" * len(ids))
    return conn.execute(f"{SELECT} WHERE operation_id IN ({marks})", _flat(ids)).fetchall()


def _flat(rows: Sequence[tuple[Any, ...]]) -> list[Any]:
    return [value for row in rows for value in row]


@functools.lru_cache(maxsize=256)
def _values_sql(template: str, count: int, width: int) -> str:
    row = "(" + ", ".join(["?"] * width) + ")"
    return template.format(values="VALUES " + ", ".join([row] * count))


@functools.lru_cache(maxsize=256)
def _repeated_sql(insert: str, count: int, tail: str) -> str:
    head, one_row = insert.split(" VALUES ", 1)
    return f"{head} VALUES {', '.join([one_row] * count)}{tail}"


def run_writes(conn: sqlite3.Connection, writes: Sequence[Callable[[sqlite3.Connection], Any]]) -> list[Any]:
    """Each write's value, in order; runs of two or more writes of a kind with `run_many` go together."""
    values: list[Any] = []
    i = 0
    while i < len(writes):
        kind = type(writes[i])
        j = i + 1
        while j < len(writes) and type(writes[j]) is kind:
            j += 1
        run = writes[i:j]
        run_many = getattr(kind, "run_many", None)
        together = run_many(conn, run) if run_many is not None and len(run) > 1 else None
        values += together if together is not None else [write(conn) for write in run]
        i = j
    return values


def _claim(
    conn: sqlite3.Connection, request: ClaimRequest, now: float, new: Operation | None = None
) -> Claim | OverBudget:
    """`new`: the operation a new key creates, when the caller built it already."""
    row = conn.execute(
        f"{SELECT} WHERE principal = ? AND session = ? AND step = ?",
        (request.principal, request.session, request.step),
    ).fetchone()
    if row is not None and row[EXPIRES_AT] is not None and row[EXPIRES_AT] <= now:  # past retention: gone
        conn.execute("DELETE FROM audit WHERE operation_id = ?", (row[0],))
        conn.execute("DELETE FROM operations WHERE operation_id = ?", (row[0],))
        row = None
    if row is None:
        return _claim_new(conn, request, now, new)
    op = decode(row)
    if op.tool != request.tool or op.fingerprint != request.fingerprint:
        return Claim(ClaimKind.CONFLICT, op)
    if lease_over(op, now):
        to_unknown(conn, op, now)
    if op.state is State.FAILED_RETRYABLE:  # certainly not applied: this caller runs it again
        return _claim_again(conn, op, request, now)
    return Claim(ClaimKind.EXISTING, op)


def _claim_unseen(
    conn: sqlite3.Connection, request: ClaimRequest, now: float, new: Operation
) -> Claim | None:
    """The common case of `_claim`, a key nobody has used, without reading the key first: the
    insert's unique index tells whether it is still new. None when anything is unusual (the key
    was taken meanwhile, a duplicate matched, the budget does not fit): then nothing was written
    and `_claim` decides, reading the key as always."""
    if request.duplicates is not None and find_duplicate(conn, request, now) is not None:
        return None
    check = request.budget
    if check is not None and budget_spent(conn, request, now) + check.amount > check.limit:
        return None
    if conn.execute(INSERT + _UNLESS_TAKEN, _insert_row(new, request)).rowcount != 1:
        return None
    conn.execute(AUDIT_CLAIMED, _claimed_row(new))
    return Claim(ClaimKind.NEW, new)


def _claim_again(
    conn: sqlite3.Connection, op: Operation, request: ClaimRequest, now: float
) -> Claim | OverBudget:
    """A FAILED_RETRYABLE operation taken over by this caller, which spends again: it must fit its
    budget, or (with `exceeded = "approval"`) it waits for a person."""
    if request.budget is not None:
        spent = budget_spent(conn, request, now)
        if spent + request.budget.amount > request.budget.limit:
            if request.budget.approval is None:
                return OverBudget(spent)
            waiting = _await_over_budget(conn, op, _over_budget_request(request, spent), now)
            return (
                Claim(ClaimKind.AWAITING, waiting) if waiting is not None else Claim(ClaimKind.EXISTING, op)
            )
    lease = Lease(request.owner, now + request.lease_seconds)
    taken = _apply(conn, op.operation_id, _retake(lease), now)
    if not isinstance(taken, Operation):
        return Claim(ClaimKind.EXISTING, op)
    if request.budget is not None:  # it spends again, now
        _spend(conn, taken.operation_id, request.budget, now)
    return Claim(ClaimKind.NEW, taken)


def _claim_new(
    conn: sqlite3.Connection, request: ClaimRequest, now: float, new: Operation | None = None
) -> Claim | OverBudget:
    """A key not seen before: claimed, unless the same action is recorded under another key, or
    its amount does not fit its budget (with `exceeded = "approval"` it then waits for a person).
    The duplicate is answered first: a repeat of an action that spent must hear that it happened."""
    check = request.duplicates
    match = find_duplicate(conn, request, now) if check is not None else None
    if match is not None and check is not None and check.reject and not check.confirmed:
        return Claim(ClaimKind.DUPLICATE, match)
    if request.budget is not None:
        spent = budget_spent(conn, request, now)
        if spent + request.budget.amount > request.budget.limit:
            if request.budget.approval is None:
                return OverBudget(spent)
            request = _over_budget_request(request, spent)
    kind = ClaimKind.NEW if request.approval is None else ClaimKind.AWAITING
    op = _insert(conn, request, now, new) if kind is ClaimKind.NEW else _insert_awaiting(conn, request, now)
    if match is not None and check is not None:  # allowed or confirmed: the match goes in the audit
        detail = {"duplicate_of": match.operation_id, "confirmed": check.confirmed}
        _audit(
            conn,
            op.operation_id,
            now,
            AuditEvent.POSSIBLE_DUPLICATE,
            None,
            op.state.value,
            op.fence,
            request.owner,
            detail,
        )
    _audit_over_budget(conn, op, request, now)
    return Claim(kind, op, match.operation_id if match is not None else None)


def _over_budget_request(request: ClaimRequest, spent: Decimal) -> ClaimRequest:
    """The request of a call past its budget that waits for an operator (`over_budget_wait`)."""
    check = request.budget
    assert check is not None
    return dataclasses.replace(request, approval=over_budget_wait(check, request.approval, spent))


def _audit_over_budget(conn: sqlite3.Connection, op: Operation, request: ClaimRequest, now: float) -> None:
    """An operation recorded to wait because it is past its budget: the budget goes in the audit."""
    over = request.approval.over_budget if request.approval is not None else None
    if over is not None:
        _audit(
            conn,
            op.operation_id,
            now,
            AuditEvent.BUDGET_EXCEEDED,
            None,
            op.state.value,
            op.fence,
            request.owner,
            over.stored(),
        )


def _await_over_budget(
    conn: sqlite3.Connection, op: Operation, request: ClaimRequest, now: float
) -> Operation | None:
    """A retryable operation taken again past its budget: it waits for a person now (None: it moved)."""
    approval = request.approval
    assert approval is not None
    moved = conn.execute(
        f"UPDATE operations SET state = {sql_state(State.AWAITING_APPROVAL)}, lease_owner = NULL,"
        " lease_expires_at = NULL, approval = ?, approval_expires_at = ?, updated_at = ?, completed_at = NULL,"
        " expires_at = NULL, budget_spent_at = NULL"
        f" WHERE operation_id = ? AND fence = ? AND state = {sql_state(State.FAILED_RETRYABLE)}",
        (dump_record(approval), approval.expires_at, now, op.operation_id, op.fence),
    ).rowcount
    if moved != 1:
        return None
    waiting = dataclasses.replace(
        op,
        state=State.AWAITING_APPROVAL,
        approval=approval,
        updated_at=now,
        completed_at=None,
        expires_at=None,
    )
    _audit(conn, op.operation_id, now, AuditEvent.APPROVAL_REQUESTED, op.state.value, waiting.state.value, op.fence,
           request.owner)  # fmt: skip
    _audit_over_budget(conn, waiting, request, now)
    return waiting


def _duplicate_of(
    principal: str, fingerprint: str, scope: str, since: str, now: str, session: str, step: str
) -> str:
    """The conditions an earlier operation meets to be a duplicate of a claim (docs/contract.md#duplicates), over
    SQL expressions for the claim's values; `scope` narrows it to the claim's session, or not. The
    fingerprint's key in the index (its prefix) finds the candidates, the whole one decides; its `+`
    keeps SQLite from substituting the claim's value into the key's expression, which the index
    would then no longer match."""
    key = FINGERPRINT_KEY.replace("fingerprint", fingerprint)
    return (
        f"principal = {principal} AND {FINGERPRINT_KEY} = {key} AND +fingerprint = {fingerprint} {scope}"
        f" AND created_at > {since}"
        f" AND state IN ({sql_states(DUPLICATE_STATES)})"
        f" AND (expires_at IS NULL OR expires_at > {now}) AND NOT (session = {session} AND step = {step})"
    )


_DUPLICATE_LOOKUP = (
    # INDEXED BY: without statistics SQLite may prefer (principal, created_at), all of a busy
    # principal's recent operations, over the few rows of one fingerprint.
    f"{SELECT} INDEXED BY operations_duplicates WHERE "
    + _duplicate_of("?1", "?2", "{session}", "?{p}", "?{p1}", "?{p2}", "?{p3}")
    + " ORDER BY created_at DESC LIMIT 1"
)
# Numbered parameters: the fingerprint appears twice. (principal, fingerprint[, session], since, now, session, step)
DUPLICATE_IN_SESSION = _DUPLICATE_LOOKUP.format(session="AND session = ?3", p=4, p1=5, p2=6, p3=7)
DUPLICATE_IN_PRINCIPAL = _DUPLICATE_LOOKUP.format(session="", p=3, p1=4, p2=5, p3=6)


def find_duplicate(conn: sqlite3.Connection, request: ClaimRequest, now: float) -> Operation | None:
    """The newest operation in scope with the same fingerprint, created within the window (indexed)."""
    check = request.duplicates
    if check is None:
        return None
    since = now - check.window_seconds
    tail = (since, now, request.session, request.step)
    if check.any_session:
        row = conn.execute(DUPLICATE_IN_PRINCIPAL, (request.principal, request.fingerprint, *tail)).fetchone()
    else:
        params = (request.principal, request.fingerprint, request.session, *tail)
        row = conn.execute(DUPLICATE_IN_SESSION, params).fetchone()
    return decode(row) if row is not None else None


# Whether any of many claims (v: principal, fingerprint, session, step, since, now, any session)
# has a duplicate: one statement for a whole batch.
_ANY_DUPLICATE = (
    "SELECT 1 FROM ({values}) AS v WHERE EXISTS (SELECT 1 FROM operations INDEXED BY operations_duplicates WHERE "
    + _duplicate_of(
        "v.column1",
        "v.column2",
        "AND (v.column7 OR session = v.column3)",
        "v.column5",
        "v.column6",
        "v.column3",
        "v.column4",
    )
    + ") LIMIT 1"
)


def _no_duplicates(conn: sqlite3.Connection, writes: Sequence[ClaimWrite]) -> bool:
    """True when no claim of the batch may be a duplicate, of the ledger or of another in the batch."""
    checked = [w for w in writes if w.request.duplicates is not None]
    if len({(w.request.principal, w.request.fingerprint) for w in checked}) != len(checked):
        return False
    rows = [_lookup_row(w.request, w.now) for w in checked]
    return all(  # no chunks (no checked claims): nothing to look up
        conn.execute(_values_sql(_ANY_DUPLICATE, len(chunk), len(chunk[0])), _flat(chunk)).fetchone() is None
        for chunk in _chunks(rows)
    )


def _lookup_row(request: ClaimRequest, now: float) -> tuple[Any, ...]:
    check = request.duplicates
    assert check is not None
    since = now - check.window_seconds
    return (
        request.principal,
        request.fingerprint,
        request.session,
        request.step,
        since,
        now,
        check.any_session,
    )


_BUDGET_SUM = (
    # INDEXED BY: the covering index answers the sum without reading a single row.
    "SELECT coalesce(sum(budget_units), 0), coalesce(sum(budget_nanos), 0) FROM operations"
    " INDEXED BY operations_budget WHERE budget = ? {scope} AND budget_spent_at > ?"
    f" AND state IN ({sql_states(BUDGET_STATES)})"
    " AND (expires_at IS NULL OR expires_at > ?)"
)
BUDGET_SUMS = {
    "all": _BUDGET_SUM.format(scope=""),
    "principal": _BUDGET_SUM.format(scope="AND principal = ?"),
    "session": _BUDGET_SUM.format(scope="AND principal = ? AND session = ?"),
}


def budget_spent(conn: sqlite3.Connection, request: ClaimRequest, now: float) -> Decimal:
    """What the request's budget scope spent within the window, as this transaction sees it."""
    assert request.budget is not None
    return spent_in(conn, request.budget, request.principal, request.session, now)


def spent_in(
    conn: sqlite3.Connection, check: BudgetCheck, principal: str, session: str, now: float
) -> Decimal:
    """What the scope of a call of `principal` and `session` spent of `check`'s budget within its window."""
    scope = tuple(v for v in scope_of(check.per, principal, session) if v is not None)
    params = (check.name, *scope, now - check.window_seconds, now)
    units, nanos = conn.execute(BUDGET_SUMS[check.per], params).fetchone()
    return joined(units, nanos)


def _spend(conn: sqlite3.Connection, operation_id: str, check: BudgetCheck, now: float) -> None:
    """The operation spends `check`'s amount now: from now on it counts, placed in the window here."""
    conn.execute(
        "UPDATE operations SET budget = ?, budget_units = ?, budget_nanos = ?, budget_spent_at = ?"
        " WHERE operation_id = ?",
        (check.name, *split(check.amount), now, operation_id),
    )


def _take_spends(
    conn: sqlite3.Connection, op: Operation, check: BudgetCheck, now: float
) -> OverBudget | None:
    """The take of an approved operation spends, if its budget has room now (OverBudget: none, nothing
    written). Not checked again: an overspend a person approved, or a record that spent already."""
    (spent_at,) = conn.execute(
        "SELECT budget_spent_at FROM operations WHERE operation_id = ?", (op.operation_id,)
    ).fetchone()
    if spent_at is not None:
        return None
    if op.approval is None or op.approval.over_budget is None:
        spent = spent_in(conn, check, op.principal, op.session, now)
        if spent + check.amount > check.limit:
            return OverBudget(spent)
    _spend(conn, op.operation_id, check, now)
    return None


def _budgets_fit(conn: sqlite3.Connection, writes: Sequence[ClaimWrite]) -> bool:
    """True when every budgeted claim of the batch fits, counting the claims before it in the batch.

    Claims that see one budget differently (a policy reloaded between them: another `per` or
    window) cannot share a running sum: False, so they run one by one."""
    shapes: dict[str, tuple[str, float]] = {}
    spent: dict[tuple[str | None, ...], Decimal] = {}
    for write in writes:
        request, check = write.request, write.request.budget
        if check is None:
            continue
        if shapes.setdefault(check.name, (check.per, check.window_seconds)) != (
            check.per,
            check.window_seconds,
        ):
            return False
        key = (check.name, *scope_of(check.per, request.principal, request.session))
        if key not in spent:
            spent[key] = budget_spent(conn, request, write.now)
        if spent[key] + check.amount > check.limit:
            return False
        spent[key] += check.amount
    return True


def _retake(lease: Lease) -> Transition:
    return Transition(
        to_state=State.RUNNING,
        expect_states=frozenset({State.FAILED_RETRYABLE}),
        event=AuditEvent.RETRY_CLAIMED,
        lease=lease,
    )


def _new_operation(request: ClaimRequest, now: float) -> Operation:
    """The RUNNING operation a claim of a new key creates (not yet written). Every field passed in
    the order of Operation's own: a keyword per field took a third of a claim's time on the caller."""
    arguments = request.arguments
    return Operation(
        new_operation_id(), request.principal, request.session, request.step, request.tool,
        request.idempotency_class, request.fingerprint, State.RUNNING, 1, 1,  # attempts, fence
        arguments if arguments is not None else json.loads(request.arguments_json),
        now, now, request.owner, now + request.lease_seconds,  # created, updated, the lease
        None, None, None, None, None,  # completed_at, expires_at, result, error, reconciliation
        request.retention_seconds, None, request.arguments_json,  # retention, approval, arguments_json
    )  # fmt: skip


def _insert_row(op: Operation, request: ClaimRequest) -> tuple[Any, ...]:
    spent_at = op.created_at if request.budget is not None else None  # it runs, so it spends, now
    return (*_claimed(op, request), *_budget_columns(request), spent_at, *_attempt(op))


def _budget_columns(request: ClaimRequest) -> tuple[str | None, int | None, int | None]:
    """The budget a new operation spends from and its amount (None for a tool without one)."""
    check = request.budget
    return (check.name, *split(check.amount)) if check is not None else (None, None, None)


def _unbudgeted_row(op: Operation, request: ClaimRequest) -> tuple[Any, ...]:
    """`_insert_row` for INSERT_UNBUDGETED: a claim without a budget."""
    return (*_claimed(op, request), *_attempt(op))


def _claimed(op: Operation, request: ClaimRequest) -> tuple[Any, ...]:
    """The columns every new operation fills, in the order both INSERTs name them first."""
    return (
        op.operation_id,
        op.principal,
        op.session,
        op.step,
        op.tool,
        op.idempotency_class.value,
        op.fingerprint,
        request.arguments_json,
        op.lease_owner,
        op.lease_expires_at,
        op.retention,
        op.created_at,
        op.updated_at,
    )


def _attempt(op: Operation) -> tuple[Any, ...]:
    return (op.lease_owner, time.monotonic())  # who runs it and the attempt's start (see `attempt_started`)


def _claimed_row(op: Operation) -> tuple[Any, ...]:
    """AUDIT_CLAIMED's parameters."""
    return (op.operation_id, op.created_at, op.lease_owner)


def _insert(
    conn: sqlite3.Connection, request: ClaimRequest, now: float, new: Operation | None = None
) -> Operation:
    op = new if new is not None else _new_operation(request, now)
    conn.execute(INSERT, _insert_row(op, request))
    conn.execute(AUDIT_CLAIMED, _claimed_row(op))
    return op


def _insert_awaiting(conn: sqlite3.Connection, request: ClaimRequest, now: float) -> Operation:
    """A new operation that waits for a person: no attempt, no lease, no fence taken yet."""
    op = dataclasses.replace(
        _new_operation(request, now),
        state=State.AWAITING_APPROVAL,
        attempts=0,
        fence=0,
        lease_owner=None,
        lease_expires_at=None,
        approval=request.approval,
    )
    expires_at = request.approval.expires_at if request.approval is not None else None
    conn.execute(
        INSERT_AWAITING,
        (op.operation_id, op.principal, op.session, op.step, op.tool, op.idempotency_class.value,
         op.fingerprint, request.arguments_json, op.retention, now, now, dump_record(op.approval), expires_at,
         *_budget_columns(request)),
    )  # fmt: skip
    _audit(conn, op.operation_id, now, AuditEvent.APPROVAL_REQUESTED, None, op.state.value, 0, request.owner)
    return op


def _apply(
    conn: sqlite3.Connection, operation_id: str, change: Transition, now: float
) -> Operation | OverBudget | None:
    row = conn.execute(f"{SELECT} WHERE operation_id = ?", (operation_id,)).fetchone()
    if row is None:
        return None
    op = decode(row)
    if op.state not in change.expect_states:
        return None
    if change.expect_fence is not None and op.fence != change.expect_fence:
        return None
    if change.budget is not None:
        refused = _take_spends(conn, op, change.budget, now)
        if refused is not None:
            return refused
    from_state = _transition(op, change, now)
    conn.execute(
        "UPDATE operations SET state = ?, attempts = ?, fence = ?, lease_owner = ?, lease_expires_at = ?,"
        " result = ?, error = ?, reconciliation = ?, updated_at = ?, completed_at = ?, expires_at = ?,"
        " approval = ? WHERE operation_id = ?",
        (
            op.state.value,
            op.attempts,
            op.fence,
            op.lease_owner,
            op.lease_expires_at,
            op.result.to_json() if op.result is not None else None,
            dump_record(op.error),
            dump_record(op.reconciliation),
            now,
            op.completed_at,
            op.expires_at,
            dump_record(op.approval),
            operation_id,
        ),
    )
    if change.lease is not None:  # a new attempt: its start, for `SQLiteLedger.attempt_start`
        conn.execute(
            "UPDATE operations SET attempt_owner = ?, attempt_started = ? WHERE operation_id = ?",
            (change.lease.owner, time.monotonic(), operation_id),
        )
    _audit(
        conn,
        operation_id,
        now,
        change.event,
        from_state.value,
        op.state.value,
        op.fence,
        recorded_actor(change.actor),
        change.detail,
    )
    return op


def _outcome(current: Operation, change: Transition, now: float) -> Operation:
    """`current` after a plain outcome, as a new object (the caller keeps its own)."""
    op = current.copy()
    _transition(op, change, now)
    return op


def _transition(op: Operation, change: Transition, now: float) -> State:
    """Move `op` as `change` says (its expectations already checked); returns the state it left."""
    from_state = op.state
    op.state = change.to_state
    op.updated_at = now
    if change.result is not None:
        op.result = change.result
    if change.error is not None or change.to_state in (State.SUCCEEDED, State.RUNNING):
        op.error = change.error
    if change.reconciliation is not None:
        op.reconciliation = change.reconciliation
    if change.approval is not None:
        op.approval = change.approval
    if change.lease is not None:
        op.fence += 1
        op.attempts += 1
        op.lease_owner, op.lease_expires_at = change.lease.owner, change.lease.expires_at
    elif change.to_state is not State.RUNNING:
        op.lease_owner = op.lease_expires_at = None
    if change.to_state.terminal:
        op.completed_at = op.completed_at if from_state is State.SUCCEEDED else now
        op.expires_at = now + op.retention
    else:
        op.completed_at = op.expires_at = None
    return from_state
