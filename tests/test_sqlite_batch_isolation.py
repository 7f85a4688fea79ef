"""One failing request inside a group commit fails alone: the others of its batch are recorded once.

Each test holds the writer thread on a first write, queues 51 requests behind it so that they
are committed as one batch, lets one of them fail (a constraint SQLite refuses, a write that
raises), and counts the rows in the ledger file through a connection of its own.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import pytest

from commitgate.server.ledger.base import Claim, ClaimKind, ClaimRequest, LedgerUnavailable, Transition
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import ToolResult

T0 = 1_700_000_000.0
RESULT = ToolResult([{"type": "text", "text": '{"ok":true}'}], {"ok": True})
SUCCEEDED = Transition(
    State.SUCCEEDED, frozenset({State.RUNNING}), AuditEvent.SUCCEEDED, expect_fence=1, result=RESULT
)


def claim(step: str, arguments_json: str | None = '{"amount":5}') -> ClaimRequest:
    # No text for the arguments (a caller bug): the NOT NULL column refuses the row inside the batch.
    return ClaimRequest(
        "alice",
        "s1",
        step,
        "charge",
        IdempotencyClass.KEY_REQUIRED,
        "fp-" + step,
        arguments_json,  # type: ignore[arg-type]
        "here:1:aaaa",
        30.0,
        3600.0,
        arguments={"amount": 5},
    )


async def in_one_batch(ledger: SQLiteLedger, requests: Sequence[Awaitable[Any]]) -> list[Any]:
    """Run `requests` while the writer is held on another write, so that they queue up and are
    committed together; asserts they took exactly one batch."""
    writer = ledger._writer
    ledger.inline_when_alone = False  # nothing may run on this thread around the writer
    held, release = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> None:
        held.set()
        release.wait(10)

    holding = asyncio.ensure_future(ledger._write(hold))
    await asyncio.to_thread(held.wait, 10)
    batches = writer.batches
    answers = asyncio.gather(*requests, return_exceptions=True)
    await asyncio.sleep(0.05)  # every request submitted: each is queued behind `hold`
    release.set()
    await holding
    results = await answers
    assert writer.batches == batches + 2  # the held write's batch, then theirs
    return results


def counts(path: Path) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """Rows per step, and audit entries per (step, event), as the file holds them."""
    with sqlite3.connect(path) as conn:
        rows = dict(conn.execute("SELECT step, count(*) FROM operations GROUP BY step").fetchall())
        audit = conn.execute(
            "SELECT o.step, a.event, count(*) FROM audit a JOIN operations o USING (operation_id)"
            " GROUP BY o.step, a.event"
        ).fetchall()
    return rows, {(step, event): n for step, event, n in audit}


@pytest.mark.anyio
async def test_a_claim_refused_inside_a_batch_fails_alone(tmp_path: Path) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    try:
        steps = [f"k{i}" for i in range(50)]
        requests = [ledger.claim(claim(step), T0) for step in steps[:25]]
        requests.append(ledger.claim(claim("bad", arguments_json=None), T0))
        requests += [ledger.claim(claim(step), T0) for step in steps[25:]]
        answers = await in_one_batch(ledger, requests)
    finally:
        await ledger.close()

    bad = answers.pop(25)
    assert isinstance(bad, LedgerUnavailable)
    assert all(isinstance(a, Claim) and a.kind is ClaimKind.NEW for a in answers)
    assert [a.operation.step for a in answers] == steps
    rows, audit = counts(tmp_path / "ledger.db")
    assert rows == dict.fromkeys(steps, 1)  # each recorded exactly once; nothing of the refused one
    assert audit == {(step, "claimed"): 1 for step in steps}


@pytest.mark.anyio
async def test_a_write_raising_inside_a_batch_of_outcomes_fails_alone(tmp_path: Path) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    try:
        steps = [f"k{i}" for i in range(50)]
        claims = [await ledger.claim(claim(step), T0) for step in steps]

        def broken(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE operations SET step = NULL WHERE step = 'k0'")  # NOT NULL: refused

        requests: list[Awaitable[Any]] = [
            ledger.update(c.operation.operation_id, SUCCEEDED, T0 + 1, current=c.operation) for c in claims
        ]
        requests.insert(10, ledger._write(broken))
        answers = await in_one_batch(ledger, requests)
    finally:
        await ledger.close()

    assert isinstance(answers.pop(10), LedgerUnavailable)
    assert [a.state for a in answers] == [State.SUCCEEDED] * 50
    rows, audit = counts(tmp_path / "ledger.db")
    assert rows == dict.fromkeys(steps, 1)
    assert audit == {**{(s, "claimed"): 1 for s in steps}, **{(s, "succeeded"): 1 for s in steps}}
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        states = conn.execute("SELECT state, count(*) FROM operations GROUP BY state").fetchall()
    assert states == [("SUCCEEDED", 50)]
