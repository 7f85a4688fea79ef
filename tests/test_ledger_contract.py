"""The ledger contract: what every backend guarantees, written against the `Ledger` protocol only.

The `ledger` fixture (conftest.py, backends in tests/support/ledgers.py) runs each test on every backend.
The last section covers what only the SQLite file can show (permissions, pragmas,
migrations) and a smoke run of the micro-benchmark.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.ledgers import OUTCOME_EVENTS, sqlite_back_to_version_7

from commitgate.server.bench.ledger import run_ledger_bench
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
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.ledger.sqlite._schema import MIGRATIONS
from commitgate.server.model.audit import Actor, AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ErrorRecord, ReconciliationNote
from commitgate.server.model.records import Operation, ToolResult

T0 = 1_700_000_000.0
OWNER = "elsewhere:1:aaaa"  # another host: never presumed dead
OTHER = "elsewhere:2:bbbb"
RESULT = ToolResult([{"type": "text", "text": '{"charge":"ch_1"}'}], {"charge": "ch_1"})


def request(
    step: str = "k1",
    *,
    principal: str = "alice",
    session: str = "s1",
    tool: str = "charge",
    fingerprint: str = "fp-1",
    owner: str = OWNER,
    lease: float = 10.0,
    retention: float = 100.0,
    cls: IdempotencyClass = IdempotencyClass.KEY_REQUIRED,
) -> ClaimRequest:
    return ClaimRequest(
        principal=principal,
        session=session,
        step=step,
        tool=tool,
        idempotency_class=cls,
        fingerprint=fingerprint,
        arguments_json='{"amount":500,"card":"4242"}',
        owner=owner,
        lease_seconds=lease,
        retention_seconds=retention,
    )


def finish(op: Operation, state: State = State.SUCCEEDED, **fields: object) -> Transition:
    event = OUTCOME_EVENTS[state]
    return Transition(state, frozenset({State.RUNNING}), event, expect_fence=op.fence, **fields)  # type: ignore[arg-type]


async def new_op(ledger: Ledger, step: str = "k1", now: float = T0, **kw: object) -> Operation:
    claim = await ledger.claim(request(step, **kw), now)  # type: ignore[arg-type]
    assert claim.kind is ClaimKind.NEW
    return claim.operation


async def completed(ledger: Ledger, step: str, state: State, now: float = T0, **kw: object) -> Operation:
    op = await new_op(ledger, step, now, **kw)
    done = await ledger.update(op.operation_id, finish(op, state, result=RESULT), now)
    assert done is not None
    return done


def dead_owner() -> str:
    """A lease owner on this host whose process has certainly exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return f"{socket.gethostname()}:{child.pid}:deadbeef"


# --- claim ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_claim_of_a_new_key_holds_a_lease(ledger: Ledger) -> None:
    claim = await ledger.claim(request(lease=7.0), T0)
    op = claim.operation
    assert claim.kind is ClaimKind.NEW
    assert (op.state, op.attempts, op.fence) == (State.RUNNING, 1, 1)
    assert (op.lease_owner, op.lease_expires_at) == (OWNER, T0 + 7.0)
    assert (op.principal, op.session, op.step, op.tool) == ("alice", "s1", "k1", "charge")
    assert op.arguments == {"amount": 500, "card": "4242"}
    assert op.completed_at is None and op.expires_at is None and op.result is None
    assert await ledger.get("alice", "s1", "k1") == op


@pytest.mark.anyio
async def test_claim_of_a_known_key_returns_the_existing_operation(ledger: Ledger) -> None:
    first = await new_op(ledger)
    again = await ledger.claim(request(owner=OTHER), T0 + 1)
    assert again.kind is ClaimKind.EXISTING
    assert again.operation.operation_id == first.operation_id
    assert (again.operation.state, again.operation.fence, again.operation.lease_owner) == (
        State.RUNNING,
        1,
        OWNER,
    )
    assert (await ledger.counts()).states[State.RUNNING.value] == 1


@pytest.mark.anyio
@pytest.mark.parametrize("changed", [{"fingerprint": "fp-2"}, {"tool": "refund"}])
async def test_claim_with_other_arguments_or_tool_conflicts(ledger: Ledger, changed: dict[str, str]) -> None:
    done = await completed(ledger, "k1", State.SUCCEEDED)
    claim = await ledger.claim(request(**changed), T0 + 1)  # type: ignore[arg-type]
    assert claim.kind is ClaimKind.CONFLICT
    assert claim.operation.operation_id == done.operation_id
    assert await ledger.get("alice", "s1", "k1") == done  # untouched


@pytest.mark.anyio
async def test_keys_are_scoped_by_principal_and_session(ledger: Ledger) -> None:
    ids = {
        (await new_op(ledger, "k1", principal=p, session=s)).operation_id
        for p in ("alice", "bob")
        for s in ("s1", "s2")
    }
    assert len(ids) == 4
    assert (await ledger.counts()).states[State.RUNNING.value] == 4


@pytest.mark.anyio
async def test_concurrent_claims_of_one_key_make_exactly_one_owner(ledger: Ledger) -> None:
    claims = await asyncio.gather(*(ledger.claim(request(owner=f"h:{i}:n"), T0) for i in range(40)))
    kinds = [c.kind for c in claims]
    assert kinds.count(ClaimKind.NEW) == 1 and kinds.count(ClaimKind.EXISTING) == 39
    assert len({c.operation.operation_id for c in claims}) == 1
    assert (await ledger.counts()).events["claimed"] == 1


@pytest.mark.anyio
async def test_claims_of_settled_keys_answer_the_same_under_load(ledger: Ledger) -> None:
    """Replays and conflicts amid a stream of new claims (a busy writer) match what they say alone."""
    done = await completed(ledger, "done", State.SUCCEEDED)
    failed = await completed(ledger, "failed", State.FAILED_FINAL)
    probes = [request("done"), request("failed"), request("done", fingerprint="fp-other")] * 10
    fresh = [request(f"new{i}") for i in range(60)]
    claims = await asyncio.gather(*(ledger.claim(r, T0 + 1) for r in [*fresh[:30], *probes, *fresh[30:]]))
    answers = claims[30:60]
    assert [(c.kind, c.operation.operation_id, c.operation.state) for c in answers] == [
        (ClaimKind.EXISTING, done.operation_id, State.SUCCEEDED),
        (ClaimKind.EXISTING, failed.operation_id, State.FAILED_FINAL),
        (ClaimKind.CONFLICT, done.operation_id, State.SUCCEEDED),
    ] * 10
    assert all(c.kind is ClaimKind.NEW for c in claims[:30] + claims[60:])
    assert answers[0].operation.result == RESULT


@pytest.mark.anyio
async def test_claim_after_retention_starts_afresh(ledger: Ledger) -> None:
    old = await completed(ledger, "k1", State.SUCCEEDED, retention=100.0)
    assert old.expires_at == T0 + 100.0
    before = await ledger.claim(request(), T0 + 99.0)
    assert (before.kind, before.operation.operation_id) == (ClaimKind.EXISTING, old.operation_id)
    after = await ledger.claim(request(fingerprint="fp-other"), T0 + 100.0)
    assert after.kind is ClaimKind.NEW  # the expired record is gone, so no conflict either
    assert after.operation.operation_id != old.operation_id
    assert await ledger.get_by_id(None, old.operation_id) is None
    assert await ledger.history(old.operation_id) == []


@pytest.mark.anyio
async def test_claim_turns_an_expired_lease_unknown(ledger: Ledger) -> None:
    op = await new_op(ledger, lease=10.0)
    live = await ledger.claim(request(), T0 + 9.9)
    assert live.operation.state is State.RUNNING
    claim = await ledger.claim(request(owner=OTHER), T0 + 10.0)
    assert claim.kind is ClaimKind.EXISTING
    assert claim.operation.state is State.UNKNOWN
    assert claim.operation.lease_owner is None and claim.operation.lease_expires_at is None
    assert claim.operation.error is not None and claim.operation.error.code == "lease_expired"
    stored = await ledger.get_by_id("alice", op.operation_id)
    assert stored is not None and stored.state is State.UNKNOWN
    last = (await ledger.history(op.operation_id))[-1]
    assert (last.event, last.from_state, last.to_state, last.fence) == (
        "lease_expired",
        "RUNNING",
        "UNKNOWN",
        1,
    )


@pytest.mark.anyio
async def test_claim_treats_a_dead_owner_on_this_host_as_expired_at_once(ledger: Ledger) -> None:
    await new_op(ledger, "dead", owner=dead_owner(), lease=3600.0)
    await new_op(ledger, "remote", owner=OTHER, lease=3600.0)
    assert (await ledger.claim(request("dead"), T0 + 1)).operation.state is State.UNKNOWN
    assert (await ledger.claim(request("remote"), T0 + 1)).operation.state is State.RUNNING


@pytest.mark.anyio
async def test_claim_of_failed_retryable_takes_over_with_the_next_fence(ledger: Ledger) -> None:
    failed = await completed(ledger, "k1", State.FAILED_RETRYABLE)
    assert failed.expires_at is not None
    claim = await ledger.claim(request(owner=OTHER, lease=5.0), T0 + 1)
    op = claim.operation
    assert claim.kind is ClaimKind.NEW and op.operation_id == failed.operation_id
    assert (op.state, op.fence, op.attempts) == (State.RUNNING, 2, 2)
    assert (op.lease_owner, op.lease_expires_at) == (OTHER, T0 + 6.0)
    assert op.completed_at is None and op.expires_at is None  # running again: not purgeable
    last = (await ledger.history(op.operation_id))[-1]
    assert (last.event, last.from_state, last.to_state, last.fence) == (
        "retry_claimed",
        "FAILED_RETRYABLE",
        "RUNNING",
        2,
    )
    # the stale first attempt can no longer record anything
    assert await ledger.update(op.operation_id, finish(failed, State.SUCCEEDED), T0 + 2) is None


# --- update ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_update_records_an_outcome(ledger: Ledger) -> None:
    op = await new_op(ledger, retention=50.0)
    change = finish(
        op,
        State.SUCCEEDED,
        result=RESULT,
        reconciliation=ReconciliationNote("status_check", verdict="found"),
        actor=Actor.operator("tester"),
        detail={"why": "because"},
    )
    done = await ledger.update(op.operation_id, change, T0 + 3)
    assert done is not None
    assert (done.state, done.result, done.error) == (State.SUCCEEDED, RESULT, None)
    assert done.reconciliation == ReconciliationNote("status_check", verdict="found")
    assert (done.completed_at, done.expires_at, done.updated_at) == (T0 + 3, T0 + 53, T0 + 3)
    assert done.lease_owner is None and done.lease_expires_at is None
    assert await ledger.get("alice", "s1", "k1") == done
    last = (await ledger.history(op.operation_id))[-1]
    assert (last.event, last.from_state, last.to_state, last.actor, last.detail) == (
        "succeeded",
        "RUNNING",
        "SUCCEEDED",
        "operator:tester",
        {"why": "because"},
    )


@pytest.mark.anyio
async def test_an_outcome_of_an_operation_the_caller_holds_leaves_the_callers_copy_alone(
    ledger: Ledger,
) -> None:
    """The ledger answers a plain outcome from the caller's operation without reading it back: as a
    new object, equal to what the ledger then holds, while the caller's still says RUNNING."""
    op = await new_op(ledger)
    before = Operation(**{name: getattr(op, name) for name in Operation.__slots__})
    done = await ledger.update(op.operation_id, finish(op, result=RESULT), T0 + 3, current=op)
    assert done is not None and done is not op
    assert op == before and op.state is State.RUNNING
    assert (done.state, done.result, done.completed_at) == (State.SUCCEEDED, RESULT, T0 + 3)
    assert await ledger.get("alice", "s1", "k1") == done


@pytest.mark.anyio
async def test_update_keeps_the_error_record(ledger: Ledger) -> None:
    op = await new_op(ledger)
    error = ErrorRecord(outcome="permanent", type="PermanentError", message="card declined")
    done = await ledger.update(op.operation_id, finish(op, State.FAILED_FINAL, error=error), T0)
    assert done is not None and done.error == error
    stored = await ledger.get("alice", "s1", "k1")
    assert stored is not None and (stored.state, stored.error) == (State.FAILED_FINAL, error)


@pytest.mark.anyio
async def test_update_applies_only_in_the_expected_state(ledger: Ledger) -> None:
    op = await new_op(ledger)
    wrong = Transition(
        State.SUCCEEDED, frozenset({State.UNKNOWN}), AuditEvent.RECONCILED_FOUND, result=RESULT
    )
    assert await ledger.update(op.operation_id, wrong, T0) is None
    assert await ledger.update("op_missing", finish(op), T0) is None
    assert await ledger.get("alice", "s1", "k1") == op
    assert [e.event for e in await ledger.history(op.operation_id)] == ["claimed"]


@pytest.mark.anyio
async def test_a_stale_fence_can_never_overwrite_a_newer_attempt(ledger: Ledger) -> None:
    first = await new_op(ledger)
    retry = Transition(
        State.RUNNING,
        frozenset({State.RUNNING}),
        AuditEvent.RETRY,
        expect_fence=1,
        lease=Lease(OTHER, T0 + 20),
    )
    newer = await ledger.update(first.operation_id, retry, T0 + 1)
    assert newer is not None and (newer.fence, newer.attempts, newer.lease_owner) == (2, 2, OTHER)
    assert newer.lease_expires_at == T0 + 20
    stale = finish(first, State.SUCCEEDED, result=RESULT)  # expects fence 1
    assert await ledger.update(first.operation_id, stale, T0 + 2) is None
    current = await ledger.get("alice", "s1", "k1")
    assert current is not None and (current.state, current.fence, current.result) == (State.RUNNING, 2, None)
    done = await ledger.update(first.operation_id, finish(newer, State.SUCCEEDED, result=RESULT), T0 + 3)
    assert done is not None and (done.state, done.fence) == (State.SUCCEEDED, 2)


@pytest.mark.anyio
async def test_renew_lease_needs_the_current_fence_and_a_running_operation(ledger: Ledger) -> None:
    op = await new_op(ledger, lease=10.0)
    assert await ledger.renew_lease(op.operation_id, 1, Lease(OWNER, T0 + 30))
    renewed = await ledger.get("alice", "s1", "k1")
    assert renewed is not None and renewed.lease_expires_at == T0 + 30
    assert not await ledger.renew_lease(op.operation_id, 2, Lease(OWNER, T0 + 60))
    assert await ledger.expire_leases(T0 + 29) == []  # the renewal kept it alive past its first lease
    await ledger.update(op.operation_id, finish(op), T0 + 1)
    assert not await ledger.renew_lease(op.operation_id, 1, Lease(OWNER, T0 + 90))


# --- lease expiry, retention ------------------------------------------------------------------


@pytest.mark.anyio
async def test_expire_leases_turns_only_expired_running_operations_unknown(ledger: Ledger) -> None:
    expired = await new_op(ledger, "expired", lease=10.0)
    await new_op(ledger, "live", lease=100.0)
    dead = await new_op(ledger, "dead", lease=100.0, owner=dead_owner())
    await completed(ledger, "done", State.SUCCEEDED, lease=1.0)
    turned = await ledger.expire_leases(T0 + 10.0)
    assert sorted(op.operation_id for op in turned) == sorted([expired.operation_id, dead.operation_id])
    assert all(op.state is State.UNKNOWN for op in turned)
    states = {op.step: op.state for op in await ledger.find(OperationFilter(principal="alice"))}
    assert states == {
        "expired": State.UNKNOWN,
        "live": State.RUNNING,
        "dead": State.UNKNOWN,
        "done": State.SUCCEEDED,
    }
    assert await ledger.expire_leases(T0 + 10.0) == []
    assert (await ledger.counts()).events["lease_expired"] == 2


@pytest.mark.anyio
async def test_purge_deletes_completed_records_after_retention_but_never_unknown(ledger: Ledger) -> None:
    succeeded = await completed(ledger, "ok", State.SUCCEEDED, retention=100.0)
    await completed(ledger, "final", State.FAILED_FINAL, retention=100.0)
    await completed(ledger, "later", State.SUCCEEDED, retention=5000.0)
    unknown = await new_op(ledger, "unknown", retention=1.0, lease=1.0)
    await ledger.expire_leases(T0 + 2)
    await new_op(ledger, "running", retention=1.0, lease=1e9)
    assert await ledger.purge(T0 + 99) == 0
    assert await ledger.purge(T0 + 1000) == 2
    left = {op.step: op.state for op in await ledger.find(OperationFilter(principal=None))}
    assert left == {"later": State.SUCCEEDED, "unknown": State.UNKNOWN, "running": State.RUNNING}
    assert await ledger.history(succeeded.operation_id) == []
    assert await ledger.history(unknown.operation_id) != []
    assert await ledger.purge(T0 + 10**9) == 1  # `later`; UNKNOWN and RUNNING stay forever


# --- reads ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_find_lists_newest_first_and_keeps_principals_apart(ledger: Ledger) -> None:
    await new_op(ledger, "k1", T0, session="s1")
    await completed(ledger, "k2", State.SUCCEEDED, T0 + 1, session="s2")
    await new_op(ledger, "k3", T0 + 2, session="s1", tool="refund")
    await new_op(ledger, "k1", T0 + 3, principal="bob")

    async def steps(**where: object) -> list[str]:
        found = await ledger.find(OperationFilter(**where))  # type: ignore[arg-type]
        return [f"{op.principal}/{op.step}" for op in found]

    assert await steps(principal="alice") == ["alice/k3", "alice/k2", "alice/k1"]
    assert await steps(principal="bob") == ["bob/k1"]
    assert await steps(principal="carol") == []
    assert await steps(principal=None) == ["bob/k1", "alice/k3", "alice/k2", "alice/k1"]
    assert await steps(principal="alice", session="s1") == ["alice/k3", "alice/k1"]
    assert await steps(principal="alice", state=State.SUCCEEDED) == ["alice/k2"]
    assert await steps(principal="alice", tool="refund") == ["alice/k3"]
    assert await steps(principal="alice", limit=2) == ["alice/k3", "alice/k2"]
    assert await steps(principal="alice", older_than=T0 + 1) == ["alice/k2", "alice/k1"]
    assert await steps(principal=None, step="k1") == ["bob/k1", "alice/k1"]
    assert await steps(principal=None, step="k1", session="s1", tool="charge") == ["bob/k1", "alice/k1"]
    assert await steps(principal="alice", step="k2", state=State.RUNNING) == []


@pytest.mark.anyio
async def test_find_breaks_ties_newest_first(ledger: Ledger) -> None:
    for step in ("a", "b", "c"):
        await new_op(ledger, step, T0)
    assert [op.step for op in await ledger.find(OperationFilter(principal="alice"))] == ["c", "b", "a"]


@pytest.mark.anyio
async def test_get_by_id_hides_other_principals_operations(ledger: Ledger) -> None:
    op = await new_op(ledger)
    assert await ledger.get_by_id("alice", op.operation_id) == op
    assert await ledger.get_by_id(None, op.operation_id) == op  # operators see everything
    assert await ledger.get_by_id("bob", op.operation_id) is None
    assert await ledger.get("bob", "s1", "k1") is None


@pytest.mark.anyio
async def test_history_has_every_attempt_and_state_change(ledger: Ledger) -> None:
    op = await new_op(ledger)
    retry = Transition(
        State.RUNNING,
        frozenset({State.RUNNING}),
        AuditEvent.RETRY,
        expect_fence=1,
        lease=Lease(OWNER, T0 + 20),
        error=ErrorRecord(outcome="retryable", message="busy"),
    )
    second = await ledger.update(op.operation_id, retry, T0 + 1)
    assert second is not None and second.error == ErrorRecord(outcome="retryable", message="busy")
    done = await ledger.update(op.operation_id, finish(second, State.SUCCEEDED, result=RESULT), T0 + 2)
    assert done is not None and done.error is None  # success clears the last attempt's error
    entries = await ledger.history(op.operation_id)
    assert [(e.event, e.from_state, e.to_state, e.fence, e.at) for e in entries] == [
        ("claimed", None, "RUNNING", 1, T0),
        ("retry", "RUNNING", "RUNNING", 2, T0 + 1),
        ("succeeded", "RUNNING", "SUCCEEDED", 2, T0 + 2),
    ]
    assert entries[0].actor == OWNER


@pytest.mark.anyio
async def test_counts_operations_by_state_and_events_by_kind(ledger: Ledger) -> None:
    await completed(ledger, "a", State.SUCCEEDED)
    await completed(ledger, "b", State.FAILED_FINAL)
    await new_op(ledger, "c")
    counts = await ledger.counts()
    assert set(State).issubset({State(k) for k in counts.states})
    states, events = counts.states, counts.events
    assert (states["SUCCEEDED"], states["FAILED_FINAL"], states["RUNNING"], states["UNKNOWN"]) == (1, 1, 1, 0)
    assert (events["claimed"], events["succeeded"], events["failed_final"]) == (3, 1, 1)


@pytest.mark.anyio
async def test_check_writable_passes_on_a_healthy_ledger(ledger: Ledger) -> None:
    await ledger.check_writable()


# --- SQLite only: the file itself ------------------------------------------------------------


@pytest.mark.anyio
async def test_sqlite_files_are_private_to_their_owner(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "ledger.db"
    ledger = await SQLiteLedger.open(path)
    try:
        await ledger.claim(request(), T0)
        for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
            mode = stat.S_IMODE(os.stat(path.parent / name).st_mode)
            assert mode == 0o600, f"{name} has mode {oct(mode)}"
        assert stat.S_IMODE(os.stat(path.parent).st_mode) & 0o077 == 0
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_sqlite_runs_in_wal_with_synchronous_full(tmp_path: Path) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    try:
        # synchronous is per connection: ask the writer's own connection
        synchronous = await ledger._write(lambda conn: conn.execute("PRAGMA synchronous").fetchone()[0])
        assert synchronous == 2  # FULL
    finally:
        await ledger.close()
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file


@pytest.mark.anyio
async def test_sqlite_migrations_are_versioned_and_idempotent(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    for _ in range(2):
        ledger = await SQLiteLedger.open(path)
        await ledger.claim(request(), T0)
        await ledger.close()
    with sqlite3.connect(path) as conn:
        versions = [v for (v,) in conn.execute("SELECT version FROM schema_version ORDER BY version")]
        assert versions == list(range(1, len(MIGRATIONS) + 1))
        conn.execute("INSERT INTO schema_version (version) VALUES (99)")
    with pytest.raises(LedgerUnavailable, match="newer"):
        await SQLiteLedger.open(path)


@pytest.mark.anyio
async def test_a_version_7_sqlite_ledger_keeps_its_counts_listings_and_leases(tmp_path: Path) -> None:
    """Open and completed records are indexed apart from version 8: what was recorded before reads
    the same after (counts by state, listings by state, leases that run out)."""
    path = tmp_path / "ledger.db"
    ledger = await SQLiteLedger.open(path)
    try:
        await completed(ledger, "ok", State.SUCCEEDED)
        retry = await new_op(ledger, "retry")
        await ledger.update(
            retry.operation_id, finish(retry, State.FAILED_RETRYABLE, error=ErrorRecord(code="x")), T0
        )
        await new_op(ledger, "lost", lease=1.0)
        await new_op(ledger, "live", lease=1e9)
    finally:
        await ledger.close()
    with sqlite3.connect(path) as conn:
        sqlite_back_to_version_7(conn)
    ledger = await SQLiteLedger.open(path)
    try:
        counts = (await ledger.counts()).states
        assert (counts["SUCCEEDED"], counts["FAILED_RETRYABLE"], counts["RUNNING"], counts["UNKNOWN"]) == (
            1,
            1,
            2,
            0,
        )
        assert [op.step for op in await ledger.expire_leases(T0 + 2)] == ["lost"]
        listed = {
            state: [op.step for op in await ledger.find(OperationFilter("alice", state=state))]
            for state in (State.SUCCEEDED, State.FAILED_RETRYABLE, State.RUNNING, State.UNKNOWN)
        }
        assert listed == {
            State.SUCCEEDED: ["ok"],
            State.FAILED_RETRYABLE: ["retry"],
            State.RUNNING: ["live"],
            State.UNKNOWN: ["lost"],
        }
        assert sum((await ledger.counts()).states.values()) == 4
    finally:
        await ledger.close()
    with sqlite3.connect(path) as conn:
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "operations_open" in indexes and "operations_state" not in indexes


@pytest.mark.anyio
async def test_a_first_version_sqlite_ledger_is_migrated_and_keeps_its_operations(tmp_path: Path) -> None:
    """The unused downstream_ref column is dropped from a ledger written by an earlier release."""
    path = tmp_path / "ledger.db"
    ledger = await SQLiteLedger.open(path)
    claim = await ledger.claim(request(), T0)
    await ledger.close()
    with sqlite3.connect(path) as conn:  # back to version 1, as an earlier release left it
        sqlite_back_to_version_7(conn)
        conn.execute("ALTER TABLE operations ADD COLUMN downstream_ref TEXT")
        conn.execute("DROP INDEX operations_duplicates")  # added by later migrations
        conn.execute("DROP INDEX operations_awaiting")
        conn.execute("ALTER TABLE operations DROP COLUMN approval")
        conn.execute("ALTER TABLE operations DROP COLUMN approval_expires_at")
        conn.execute("DROP INDEX operations_budget")
        for column in ("budget_spent_at", "budget_units", "budget_nanos", "budget"):
            conn.execute(f"ALTER TABLE operations DROP COLUMN {column}")
        conn.execute("DELETE FROM schema_version WHERE version > 1")
    ledger = await SQLiteLedger.open(path)
    try:
        kept = await ledger.get_by_id(None, claim.operation.operation_id)
        assert kept is not None and kept.state is State.RUNNING
    finally:
        await ledger.close()
    with sqlite3.connect(path) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(operations)")]
        assert "downstream_ref" not in columns
        added = {"approval", "approval_expires_at", "budget", "budget_units", "budget_spent_at"}
        assert added <= set(columns)


@pytest.mark.anyio
async def test_sqlite_ledger_that_cannot_be_created_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(LedgerUnavailable):
        await SQLiteLedger.open(blocker / "ledger.db")


@pytest.mark.anyio
async def test_sqlite_a_failing_step_takes_only_itself_down(tmp_path: Path) -> None:
    """Steps committed together (group commit): one that fails leaves no trace and harms no other."""
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute(
            "INSERT INTO audit (operation_id, id, at, event, fence) VALUES ('op_x', 1, 0, 'half-done', 0)"
        )
        raise ValueError("a step that fails after writing")

    try:
        claims = [ledger.claim(request(f"k{i}"), T0) for i in range(30)]
        results = await asyncio.gather(
            *claims[:15], ledger._write(broken), *claims[15:], return_exceptions=True
        )
        failure = results.pop(15)
        assert isinstance(failure, ValueError)
        assert all(isinstance(r, Claim) and r.kind is ClaimKind.NEW for r in results)
        counts = await ledger.counts()
        assert (counts.states["RUNNING"], counts.events["claimed"], counts.events.get("half-done", 0)) == (
            30,
            30,
            0,
        )
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_sqlite_a_step_sqlite_refuses_in_a_group_commit_is_a_ledger_failure(tmp_path: Path) -> None:
    """A write SQLite refuses (here a constraint; a full disk or a schema the write does not fit
    alike) means the ledger could not record: LedgerUnavailable, so the caller answers
    ledger_unavailable and runs nothing, whether its write ran alone or with company."""
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")

    def refused(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO audit (operation_id, at, event, fence) VALUES ('op_x', 0, 'no id', 0)")

    try:
        claims = [ledger.claim(request(f"k{i}"), T0) for i in range(10)]
        results = await asyncio.gather(
            *claims[:5], ledger._write(refused), *claims[5:], return_exceptions=True
        )
        failure = results.pop(5)
        assert isinstance(failure, LedgerUnavailable) and "NOT NULL" in str(failure)
        assert all(isinstance(r, Claim) and r.kind is ClaimKind.NEW for r in results)
    finally:
        await ledger.close()


@pytest.mark.anyio
async def test_micro_benchmark_runs_and_reports_its_figures(tmp_path: Path) -> None:
    figures = await run_ledger_bench(tmp_path / "bench.db", ops=40, tasks=4)
    assert figures["synchronous"] == "FULL"
    for name in ("sequential_claim_complete", "dedup_hit"):
        assert figures[name]["ops"] == 40
        assert 0 < figures[name]["median_us"] <= figures[name]["p99_us"]
    lookup = figures["duplicate_lookup"]
    assert lookup["ops"] == 40 and lookup["on_median_us"] > 0 and lookup["off_median_us"] > 0
    concurrent = figures["concurrent_claim_complete"]
    assert (concurrent["tasks"], concurrent["ops"]) == (4, 40)
    assert concurrent["ops_per_s"] > 0 and concurrent["mean_batch"] >= 1


@pytest.mark.anyio
async def test_a_closed_sqlite_ledger_answers_unavailable_instead_of_hanging(tmp_path: Path) -> None:
    closed = await SQLiteLedger.open(tmp_path / "closed.db")
    await closed.close()
    with pytest.raises(LedgerUnavailable):
        await asyncio.wait_for(closed.purge(0.0), timeout=5)
