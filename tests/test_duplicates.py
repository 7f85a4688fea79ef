"""Duplicate detection in the ledger (every backend) and the answer the model reads.

The claim of a key not seen before looks for the same fingerprint in scope within the window,
inside the claim's own atomic step: these tests hold every backend to that, including N
concurrent fresh keys (exactly one claimed) and an indexed lookup. The end-to-end behaviour
through server processes is in test_duplicates_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path

import pytest
from test_ledger_contract import OWNER, RESULT, T0, finish, request

from commitgate.server.core import duplicates
from commitgate.server.core.views import status_view
from commitgate.server.ledger.base import ClaimKind, ClaimRequest, DuplicateCheck, Ledger
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.ledger.sqlite._writes import DUPLICATE_IN_PRINCIPAL, DUPLICATE_IN_SESSION
from commitgate.server.model.facts import ErrorCode, IdempotencyClass, State
from commitgate.server.model.notes import ErrorRecord
from commitgate.server.model.records import Operation, ToolResult

REJECT = DuplicateCheck(window_seconds=600.0, any_session=False, reject=True)


def checked(step: str, check: DuplicateCheck | None = REJECT, **kw: object) -> ClaimRequest:
    return dataclasses.replace(request(step, **kw), duplicates=check)  # type: ignore[arg-type]


async def claimed(ledger: Ledger, step: str, now: float = T0, **kw: object) -> Operation:
    claim = await ledger.claim(checked(step, **kw), now)  # type: ignore[arg-type]
    assert claim.kind is ClaimKind.NEW, claim
    return claim.operation


@pytest.mark.anyio
async def test_a_fresh_key_with_the_same_fingerprint_is_a_duplicate_and_records_nothing(
    ledger: Ledger,
) -> None:
    first = await claimed(ledger, "k1")
    again = await ledger.claim(checked("k2"), T0 + 1)
    assert again.kind is ClaimKind.DUPLICATE
    assert again.operation.operation_id == first.operation_id
    assert await ledger.get("alice", "s1", "k2") is None
    assert (await ledger.counts()).states[State.RUNNING.value] == 1
    # the same key is never its own duplicate: it is the existing operation
    assert (await ledger.claim(checked("k1"), T0 + 1)).kind is ClaimKind.EXISTING


@pytest.mark.anyio
async def test_what_counts_as_the_same_action(ledger: Ledger) -> None:
    await claimed(ledger, "k1")
    await claimed(ledger, "k2", fingerprint="fp-other")  # other arguments
    await claimed(ledger, "k3", session="s2")  # another session (scope session)
    await claimed(ledger, "k4", principal="bob")  # another principal
    await claimed(ledger, "k5", T0 + 601)  # past the window
    await claimed(ledger, "k6", check=None)  # detection off
    scope_principal = dataclasses.replace(REJECT, any_session=True)
    refused = await ledger.claim(checked("k7", scope_principal, session="s9"), T0 + 602)
    assert refused.kind is ClaimKind.DUPLICATE and refused.operation.step == "k5"  # the newest in scope


@pytest.mark.anyio
@pytest.mark.parametrize("state", [State.FAILED_FINAL, State.FAILED_RETRYABLE])
async def test_a_failed_operation_is_not_a_duplicate(ledger: Ledger, state: State) -> None:
    op = await claimed(ledger, "k1")
    assert await ledger.update(op.operation_id, finish(op, state, error=ErrorRecord(message="no")), T0)
    await claimed(ledger, "k2", T0 + 1)


@pytest.mark.anyio
async def test_a_succeeded_or_unknown_operation_is(ledger: Ledger) -> None:
    op = await claimed(ledger, "k1")
    assert await ledger.update(op.operation_id, finish(op, State.SUCCEEDED, result=RESULT), T0)
    assert (await ledger.claim(checked("k2"), T0 + 1)).kind is ClaimKind.DUPLICATE
    other = await claimed(ledger, "u1", fingerprint="fp-u")
    assert await ledger.update(
        other.operation_id, finish(other, State.UNKNOWN, error=ErrorRecord(message="1")), T0
    )
    assert (await ledger.claim(checked("u2", fingerprint="fp-u"), T0 + 1)).kind is ClaimKind.DUPLICATE


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["allow", "confirmed"])
async def test_an_allowed_match_is_claimed_and_recorded_in_the_audit(ledger: Ledger, how: str) -> None:
    first = await claimed(ledger, "k1")
    check = (
        dataclasses.replace(REJECT, reject=False)
        if how == "allow"
        else dataclasses.replace(REJECT, confirmed=True)
    )
    claim = await ledger.claim(checked("k2", check), T0 + 1)
    assert claim.kind is ClaimKind.NEW and claim.duplicate_of == first.operation_id
    events = {e.event: e for e in await ledger.history(claim.operation.operation_id)}
    assert events["possible_duplicate"].detail == {
        "duplicate_of": first.operation_id,
        "confirmed": how == "confirmed",
    }


@pytest.mark.anyio
async def test_n_concurrent_fresh_keys_claim_exactly_once(ledger: Ledger) -> None:
    claims = await asyncio.gather(*(ledger.claim(checked(f"k{i}"), T0) for i in range(16)))
    kinds = sorted(c.kind.value for c in claims)
    assert kinds == ["duplicate"] * 15 + ["new"]
    (winner,) = [c.operation for c in claims if c.kind is ClaimKind.NEW]
    assert {c.operation.operation_id for c in claims} == {winner.operation_id}
    assert (await ledger.counts()).states[State.RUNNING.value] == 1


@pytest.mark.anyio
async def test_distinct_actions_claimed_together_all_go_through(ledger: Ledger) -> None:
    claims = await asyncio.gather(
        *(ledger.claim(checked(f"k{i}", fingerprint=f"fp-{i}"), T0) for i in range(16))
    )
    assert {c.kind for c in claims} == {ClaimKind.NEW}


# --- an indexed lookup, not a scan ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_sqlite_lookup_uses_its_index(tmp_path: Path) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    await ledger.claim(checked("k1"), T0)
    await ledger.close()
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        for sql, params in (
            (DUPLICATE_IN_SESSION, ("alice", "fp", "s1", 0, 0, "s1", "k")),
            (DUPLICATE_IN_PRINCIPAL, ("alice", "fp", 0, 0, "s1", "k")),
        ):
            plan = " ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
            assert "USING INDEX operations_duplicates (principal=? AND <expr>=?" in plan, plan
            assert "SCAN" not in plan, plan


@pytest.mark.anyio
async def test_fingerprints_that_share_their_indexed_prefix_are_different_actions(ledger: Ledger) -> None:
    """SQLite indexes a fingerprint's first 16 characters: the whole fingerprint still decides."""
    await claimed(ledger, "k1", fingerprint="a" * 16 + "1")
    await claimed(ledger, "k2", fingerprint="a" * 16 + "2")
    together = await asyncio.gather(
        *(ledger.claim(checked(f"b{i}", fingerprint="b" * 16 + str(i)), T0) for i in range(4))
    )
    assert {c.kind for c in together} == {ClaimKind.NEW}
    assert (await ledger.claim(checked("k3", fingerprint="a" * 16 + "1"), T0 + 1)).kind is ClaimKind.DUPLICATE


@pytest.mark.anyio
async def test_a_ledger_indexed_by_whole_fingerprints_is_migrated_and_its_operations_still_count(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SQLiteLedger.open(path)
    first = await claimed(ledger, "k1")
    await ledger.close()
    with sqlite3.connect(path) as conn:  # the index as version 11 left it
        conn.execute("DROP INDEX operations_duplicates")
        conn.execute(
            "CREATE INDEX operations_duplicates ON operations (principal, fingerprint, session, created_at)"
        )
        conn.execute("DELETE FROM schema_version WHERE version > 11")
    ledger = await SQLiteLedger.open(path)
    try:
        again = await ledger.claim(checked("k2"), T0 + 1)
        assert again.kind is ClaimKind.DUPLICATE and again.operation.operation_id == first.operation_id
    finally:
        await ledger.close()
    with sqlite3.connect(path) as conn:
        (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'operations_duplicates'").fetchone()
    assert "substr(fingerprint, 1, 16)" in sql, sql


@pytest.mark.anyio
@pytest.mark.postgres
async def test_the_postgres_lookup_uses_its_index() -> None:
    from support.postgres import plan_on_fresh_ledger

    plan = await plan_on_fresh_ledger(
        "SELECT * FROM commitgate_operations o WHERE o.principal = 'a' AND o.fingerprint = 'f'"
        " AND o.session = 's' AND o.created_at > 0 AND o.state IN ('RUNNING', 'SUCCEEDED')"
        " ORDER BY o.created_at DESC LIMIT 1"
    )
    assert "commitgate_operations_duplicates" in plan, plan


# --- the answer the model reads ---------------------------------------------------------------------------


def operation(state: State, **fields: object) -> Operation:
    op = Operation(
        operation_id="op_1",
        principal="alice",
        session="run-1",
        step="charge-1",
        tool="charge_card",
        idempotency_class=IdempotencyClass.KEY_REQUIRED,
        fingerprint="fp",
        state=state,
        attempts=1,
        fence=1,
        arguments={},
        created_at=T0,
        updated_at=T0,
        lease_owner=OWNER,
    )
    return dataclasses.replace(op, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "sentence"),
    [
        (State.SUCCEEDED, 'It succeeded with this result: {"charge":"ch_1"}.'),
        (State.RUNNING, "It is still running; its result is not known yet."),
        (
            State.UNKNOWN,
            "Its outcome is unknown: it may have taken effect, so repeating it could do it twice.",
        ),
    ],
)
def test_the_message_says_what_happened_when_and_what_to_do(state: State, sentence: str) -> None:
    op = operation(state, result=RESULT if state is State.SUCCEEDED else None)
    error = duplicates.possible_duplicate(op, status_view(op, False, T0 + 300), "charge_card", T0 + 300)
    assert error.code is ErrorCode.POSSIBLE_DUPLICATE and error.operation is None
    assert error.details["duplicate_of"]["operation_id"] == "op_1"
    text = error.message
    assert "nothing was executed now" in text
    assert (
        "5 minutes ago (2023-11-14T22:13:20.000Z) in session 'run-1', under idempotency_key 'charge-1'"
        in text
    )
    assert sentence in text
    assert "do not call again" in text
    assert "call again with a new idempotency_key and confirm_duplicate: true" in text


def test_a_long_result_is_cut_in_the_text_but_whole_in_duplicate_of() -> None:
    long = ToolResult([{"type": "text", "text": "x" * 5000}], {"blob": "x" * 5000})
    op = operation(State.SUCCEEDED, result=long)
    error = duplicates.possible_duplicate(op, status_view(op, False, T0), "charge_card", T0)
    assert len(error.message) < 2000 and "x" * 600 + "..." in error.message
    assert error.details["duplicate_of"]["result"]["structuredContent"] == {"blob": "x" * 5000}
