"""Receipts and outbox events under concurrency, on each backend: group commits (SQLite) and concurrent
transactions on their own chains (PostgreSQL) leave every audit entry with exactly one receipt, every
chain whole, and one event per event-causing change."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import pytest

from commitgate.server.ledger import evidence
from commitgate.server.ledger.base import BudgetCheck, ClaimKind, ClaimRequest, Ledger, Transition
from commitgate.server.ledger.evidence import BudgetLine, Evidence, Evidenced, Route, Settled, Signer
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.receipts import check_chains
from commitgate.server.model.records import ToolResult

pytestmark = pytest.mark.anyio

CALLS = 40


async def call(ledger: Ledger, n: int) -> None:
    """A claim and its outcome: every fourth one UNKNOWN (an event), the others SUCCEEDED."""
    now = time.time()
    request = ClaimRequest(
        "p", "s", f"k{n}", "tool", IdempotencyClass.KEY_REQUIRED, f"fp{n}", f'{{"n":{n}}}', "me", 30, 3600
    )
    op = (await ledger.claim(request, now)).operation
    unknown = n % 4 == 0
    change = Transition(
        to_state=State.UNKNOWN if unknown else State.SUCCEEDED,
        expect_states=frozenset({State.RUNNING}),
        event=AuditEvent.AMBIGUOUS if unknown else AuditEvent.SUCCEEDED,
        expect_fence=op.fence,
        result=None if unknown else ToolResult.from_json('{"content":[]}'),
    )
    assert await ledger.update(op.operation_id, change, time.time(), current=op) is not None


async def test_concurrent_changes_each_get_one_receipt_in_whole_chains(
    ledger: Ledger, tmp_path: Path
) -> None:
    signer = Signer.load(tmp_path / "key.pem", create=True)
    with_evidence = cast(Any, ledger)
    with_evidence.attach(Evidence(signer, [Route("hook", frozenset({"unknown"}))]))
    await asyncio.gather(*(call(ledger, n) for n in range(CALLS)))
    evidenced = cast(Evidenced, ledger)
    receipts = await evidenced.receipts()
    counts = await ledger.counts()
    assert len(receipts) == sum(counts.events.values()) == 2 * CALLS
    assert len({(r["operation_id"], r["transition"]) for r in receipts}) == 2 * CALLS  # none twice
    verdict = check_chains(receipts, {signer.public_hex})
    assert verdict.whole, verdict.problem
    events = await evidenced.undelivered()
    assert sorted(e.operation_id for e in events) == sorted(
        r["operation_id"] for r in receipts if r["transition"] == AuditEvent.AMBIGUOUS
    )
    assert {e.event for e in events} == {"unknown"}


async def test_budget_near_once_when_spending_crosses_ninety_percent(ledger: Ledger, tmp_path: Path) -> None:
    line = BudgetLine(Decimal(100), "principal", 3600.0)
    hook = Route("hook", frozenset({"budget_near"}))
    cast(Any, ledger).attach(Evidence(Signer.load(tmp_path / "key.pem", create=True), [hook], {"pay": line}))
    for n, amount in enumerate([30, 30, 30, 5]):  # 30, 60, 90 (the mark), 95 (already past it)
        now = time.time()
        check = BudgetCheck("pay", "principal", Decimal(amount), line.limit, line.window_seconds)
        request = ClaimRequest(
            "p", "s", f"b{n}", "pay", IdempotencyClass.KEY_REQUIRED, f"fb{n}", f'{{"n":{n}}}', "me", 30, 3600,
            budget=check,
        )  # fmt: skip
        assert (await ledger.claim(request, now)).kind is ClaimKind.NEW
    events = await cast(Evidenced, ledger).undelivered()
    assert [e.event for e in events] == ["budget_near"]
    third = await ledger.get("p", "s", "b2")
    assert third is not None and events[0].operation_id == third.operation_id


async def test_an_event_is_leased_to_one_sender_at_a_time(ledger: Ledger, tmp_path: Path) -> None:
    cast(Any, ledger).attach(Evidence(None, [Route("hook", frozenset({"unknown"}))]))
    await asyncio.gather(*(call(ledger, n) for n in range(0, 16, 4)))  # four UNKNOWN outcomes: four events
    outbox = cast(Evidenced, ledger)
    now = time.time()
    first, second = await asyncio.gather(
        outbox.outbox_take("one", now, 60.0, 10), outbox.outbox_take("two", now, 60.0, 10)
    )
    assert sorted(e.event_id for e in first + second) == sorted({e.event_id for e in first + second})
    assert len(first) + len(second) == 4
    item = (first or second)[0]
    assert await outbox.outbox_take("three", now, 60.0, 10) == []  # all leased
    assert not await outbox.outbox_settle(item, "someone-else", Settled(now, delivered_at=now))
    assert await outbox.outbox_take("three", now + 61, 60.0, 10) != []  # leases run out: sent again


def test_processes_starting_together_share_one_new_key(tmp_path: Path) -> None:
    path = tmp_path / "state" / "receipts-key.pem"
    with ThreadPoolExecutor(8) as pool:
        keys = set(pool.map(lambda _: Signer.load(path, create=True).public_hex, range(16)))
    assert len(keys) == 1 and sorted(p.name for p in path.parent.iterdir()) == ["receipts-key.pem"]
    assert path.stat().st_mode & 0o777 == 0o600


async def test_sealing_a_transaction_reads_by_key_never_by_scanning(tmp_path: Path) -> None:
    """What every transaction runs to seal itself stays one seek each, however large the ledger."""
    path = tmp_path / "ledger.db"
    await (await SQLiteLedger.open(path)).close()
    plans: dict[str, tuple[str, list[Any]]] = {
        "due (one)": (evidence._SQLITE_DUE_ONE, ["op", 1]),
        "due (many)": (evidence._SQLITE_DUE.format(marks="(?, ?), (?, ?)"), ["op", 1, "op", 2]),
        "writer": (evidence._SQLITE_WRITER, ["w"]),
        "head": (evidence._SQLITE_HEAD, [1]),
        "spent": (evidence._SQLITE_SPENT, ["op"]),
        "sum": (evidence._SQLITE_SUM, ["pay", "p", "p", None, None, 0.0, 1.0]),
    }
    with sqlite3.connect(path) as conn:
        for name, (sql, params) in plans.items():
            steps = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
            assert not [
                s for s in steps if s.startswith("SCAN") and "CONSTANT ROW" not in s and s != "SCAN v"
            ], (name, steps)


@pytest.mark.parametrize("batched", [False, True])
async def test_a_transaction_sealed_then_rolled_back_leaves_no_gap_in_its_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    """The writer keeps each chain's head between transactions, taken on from a transaction only once
    it committed: one that built its receipts and then did not commit (a failed COMMIT) must not
    move it, or the next receipt would leave a gap."""
    from commitgate.server.ledger.sqlite import _writer

    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    signer = Signer.load(tmp_path / "key.pem", create=True)
    ledger.attach(Evidence(signer))
    seal, failures = evidence.seal_sqlite, [1]

    def seal_then_fail(conn: sqlite3.Connection, *args: Any) -> None:
        seal(conn, *args)
        if failures and (conn is ledger._writer._conn) is batched:
            failures.pop()
            raise sqlite3.OperationalError("disk I/O error")

    try:
        await call(ledger, 0)
        monkeypatch.setattr(_writer, "seal_sqlite", seal_then_fail)
        if batched:  # a group commit: its writes run again, each on its own, and commit
            await asyncio.gather(*(call(ledger, n) for n in range(1, 9)))
            assert not failures
        else:  # a write run inline: it fails, the next one commits
            with pytest.raises(Exception, match="disk I/O error"):
                await call(ledger, 1)
            await call(ledger, 2)
        receipts = await ledger.receipts()
        verdict = check_chains(receipts, {signer.public_hex})
        assert verdict.whole, verdict.problem
        assert len(receipts) == sum((await ledger.counts()).events.values())
    finally:
        await ledger.close()


async def test_a_kept_chain_head_behind_the_file_is_read_again(tmp_path: Path) -> None:
    """A head kept from before the file's last receipt of the chain (another writer of the chain on
    the file) would repeat a `seq`: the writer reads the file's head and signs again."""
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    signer = Signer.load(tmp_path / "key.pem", create=True)
    ledger.attach(Evidence(signer))
    try:
        await call(ledger, 0)
        heads = ledger._writer._heads
        (chain, _), *_ = heads.items()
        stale = dict(heads)
        await call(ledger, 1)
        heads.update(stale)
        await call(ledger, 2)
        receipts = await ledger.receipts()
        verdict = check_chains(receipts, {signer.public_hex})
        assert verdict.whole, verdict.problem
        assert [r["seq"] for r in receipts if r["writer"] == chain] == list(range(1, 7))
    finally:
        await ledger.close()


def test_a_receipt_time_is_datetimes_text_at_the_microsecond() -> None:
    """`at_text` formats a second once for all its receipts: the text stays datetime's exactly,
    at the edges of rounding to the microsecond (into the next second, halves) and across days."""
    from datetime import UTC, datetime

    from support.rounding_times import rounding_times

    from commitgate.server.model.receipts import at_text

    edges = (0.0, 1_700_000_000.0000005, 1_700_000_000.9999996, 1_700_000_000.9999995, 1_764_604_800.123456)
    for ts in rounding_times(edges, seed=11):
        expected = datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
        assert at_text(ts) == expected, ts
