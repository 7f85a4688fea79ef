"""`[ledger] durability`: "full" syncs the claim and the outcome; "claim" syncs the claim only.

Under "claim" the outcome is committed at once (every process sees it) but its transaction runs
with synchronous=NORMAL: no sync of its own. The next synced commit, or the ledger's syncer within
`outcome_sync_within`, makes it durable. A power loss before that leaves the operation RUNNING on
disk, which its lease turns UNKNOWN: never executed twice. Each test uses a real ledger file; the
synchronous setting a transaction commits with is read from SQLite inside that very transaction.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from support.boundary import FakeClock, ScriptedTool, SystemOfRecord, call_request, guarded, make_boundary

from commitgate.server.ledger import open_ledger
from commitgate.server.ledger.base import ClaimKind, ClaimRequest, Transition
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.ledger.sqlite._writes import ClaimWrite, OutcomeWrite
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import ToolResult
from commitgate.server.policy.loading import loads_policy
from commitgate.server.policy.problems import PolicyError

pytestmark = pytest.mark.anyio

FULL, NORMAL = 2, 1  # what `PRAGMA synchronous` answers
SUCCEEDED = Transition(
    State.SUCCEEDED,
    frozenset({State.RUNNING}),
    AuditEvent.SUCCEEDED,
    expect_fence=1,
    result=ToolResult([{"type": "text", "text": "ok"}], {"ok": True}),
)


def request(step: str) -> ClaimRequest:
    return ClaimRequest(
        "alice", "s1", step, "charge", IdempotencyClass.KEY_REQUIRED, "fp-" + step, "{}", "me:1:a", 10.0, 60.0
    )


@pytest.fixture
def commit_modes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(write kind, the synchronous setting of the transaction it ran in), for every claim and outcome."""
    seen: list[tuple[str, int]] = []
    for kind, cls in (("claim", ClaimWrite), ("outcome", OutcomeWrite)):
        one, many = cls.__call__, cls.run_many

        def recording(self: Any, conn: Any, _kind: str = kind, _one: Any = one) -> Any:
            seen.append((_kind, conn.execute("PRAGMA synchronous").fetchone()[0]))
            return _one(self, conn)

        def recording_many(conn: Any, writes: Any, _kind: str = kind, _many: Any = many) -> Any:
            values = _many(conn, writes)
            if values is not None:  # else each runs on its own, through __call__
                seen.extend([(_kind, conn.execute("PRAGMA synchronous").fetchone()[0])] * len(writes))
            return values

        monkeypatch.setattr(cls, "__call__", recording)
        monkeypatch.setattr(cls, "run_many", staticmethod(recording_many))
    return seen


async def claim_and_complete(ledger: SQLiteLedger, step: str) -> None:
    claim = await ledger.claim(request(step), time.time())
    assert claim.kind is ClaimKind.NEW
    assert await ledger.update(claim.operation.operation_id, SUCCEEDED, time.time(), current=claim.operation)


@pytest.mark.parametrize("durability", ["full", "claim"])
async def test_the_outcome_commits_without_a_sync_only_under_claim_durability(
    tmp_path: Path, commit_modes: list[tuple[str, int]], durability: str
) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db", durability=durability, outcome_sync_within=30.0)
    try:
        for i in range(3):  # alone: inline on the caller's thread
            await claim_and_complete(ledger, f"alone{i}")
        await asyncio.gather(*(claim_and_complete(ledger, f"together{i}") for i in range(20)))  # the writer
    finally:
        await ledger.close()
    claims = {mode for kind, mode in commit_modes if kind == "claim"}
    outcomes = [mode for kind, mode in commit_modes if kind == "outcome"]
    assert claims == {FULL}  # a claim is always on disk before the effect
    assert len(outcomes) == 23
    if durability == "full":
        assert set(outcomes) == {FULL}
    else:
        assert outcomes[:3] == [NORMAL] * 3
        # In a group commit an outcome shares its transaction with claims (then it is synced with
        # them) or with outcomes only (then none of them syncs).
        assert NORMAL in outcomes[3:]


async def test_an_unsynced_outcome_is_synced_within_the_window(tmp_path: Path) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db", durability="claim", outcome_sync_within=0.05)
    try:
        await claim_and_complete(ledger, "k1")
        assert ledger.unsynced_outcomes == 1
        deadline = time.monotonic() + 5
        while ledger.unsynced_outcomes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert ledger.unsynced_outcomes == 0
    finally:
        await ledger.close()


async def test_the_next_synced_claim_syncs_the_outcomes_before_it(tmp_path: Path) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db", durability="claim", outcome_sync_within=60.0)
    try:
        await claim_and_complete(ledger, "k1")
        assert ledger.unsynced_outcomes == 1
        await ledger.claim(request("k2"), time.time())  # a synced commit syncs the whole WAL
        assert ledger.unsynced_outcomes == 0
    finally:
        await ledger.close()


async def test_a_power_loss_before_the_outcome_sync_leaves_unknown_not_a_second_run(tmp_path: Path) -> None:
    """The disk after a power loss holds what was synced: here everything up to the claim. The
    copy of the files taken then is that disk; a server on it answers UNKNOWN and runs nothing."""
    record = SystemOfRecord(tmp_path / "record.db")
    source = ScriptedTool(record, ["hold_after"])
    tool = guarded("charge", "key-required", source)
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db", durability="claim", outcome_sync_within=60.0)
    disk = tmp_path / "after-power-loss"
    disk.mkdir()
    try:
        call = asyncio.create_task(make_boundary(ledger, [tool]).call(call_request(tool, "k1")))
        while record.count() == 0:  # the effect happened; the outcome is not recorded yet
            await asyncio.sleep(0.005)
        for name in ("ledger.db", "ledger.db-wal"):
            shutil.copy(tmp_path / name, disk / name)
        source.release()
        answer = await call
        assert answer.error is None and answer.operation is not None
        assert answer.operation.state is State.SUCCEEDED
        assert ledger.unsynced_outcomes == 1  # committed, not yet on disk: the window a power loss hits
    finally:
        await ledger.close()

    clock = FakeClock(time.time() + 60)  # the dead server's lease is over
    after = await SQLiteLedger.open(disk / "ledger.db", durability="claim")
    try:
        again = await make_boundary(after, [tool], clock=clock).call(call_request(tool, "k1"))
        assert again.error is not None and again.error.code.value == "operation_outcome_unknown"
        assert again.operation is not None and again.operation.state is State.UNKNOWN
    finally:
        await after.close()
    assert record.count() == 1  # one effect: the retry after the power loss ran nothing


def test_the_policy_takes_durability_and_refuses_anything_else() -> None:
    policy = loads_policy('[ledger]\ndurability = "claim"\noutcome_sync_within = "20ms"\n')
    assert (policy.ledger.durability, policy.ledger.outcome_sync_within) == ("claim", 0.02)
    assert loads_policy("").ledger.durability == "full"
    with pytest.raises(PolicyError, match="durability: must be 'full' or 'claim'"):
        loads_policy('[ledger]\ndurability = "none"\n')


async def test_open_ledger_passes_durability_to_the_sqlite_ledger(tmp_path: Path) -> None:
    ledger = await open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}", durability="claim")
    try:
        assert isinstance(ledger, SQLiteLedger)
        await claim_and_complete(ledger, "k1")
        assert ledger.unsynced_outcomes == 1
    finally:
        await ledger.close()


@pytest.mark.postgres
async def test_postgres_records_the_outcome_under_claim_durability() -> None:
    """On PostgreSQL the outcome's own transaction runs with synchronous_commit = off; it is still
    committed before the answer: every connection reads it at once."""
    from support.postgres import open_test_ledger

    ledger = await open_test_ledger(durability="claim")
    try:
        assert ledger.lazy_outcomes
        claim = await ledger.claim(request("k1"), time.time())
        recorded = await ledger.update(claim.operation.operation_id, SUCCEEDED, time.time())
        assert recorded is not None and recorded.state is State.SUCCEEDED
        again = await ledger.get("alice", "s1", "k1")
        assert again is not None and again.state is State.SUCCEEDED and again.result == SUCCEEDED.result
    finally:
        await ledger.close()
