"""What the SQLite ledger keeps off the event loop's per-claim path, and the guarantees it keeps.

A system call on the event loop gives up the GIL, and while the writer thread is busy it takes it
then: the loop waits for the writer's whole Python turn. So a claim's operation id draws its
random bits from a pool, not from one `os.urandom` call each, and under load the check that the
ledger file is still the one at its path runs once per batch on the writer, not once per claim on
the loop. These tests hold the guarantees behind both: ids stay unique (a forked child included),
and a claim is never written into a file that left its path, however busy the writer is.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from pathlib import Path

import pytest

from commitgate.server.ledger.base import ClaimKind, ClaimRequest, LedgerUnavailable, Transition
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.ledger.sqlite._ids import new_operation_id
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import ToolResult

pytestmark = pytest.mark.anyio

T0 = 1_700_000_000.0
ID = re.compile(r"op_[0-9a-f]{32}")


def request(step: str) -> ClaimRequest:
    return ClaimRequest(
        "alice", "s1", step, "refund", IdempotencyClass.KEY_REQUIRED, f"fp-{step}",
        '{"amount_cents":500}', "here:1:aaaa", 30.0, 3600.0,
    )  # fmt: skip


def test_operation_ids_are_unique_and_ordered_by_time() -> None:
    ids = [new_operation_id() for _ in range(5000)]  # several fetches of the random pool
    assert all(ID.fullmatch(i) for i in ids)
    assert len({i[-18:] for i in ids}) == len(ids)  # not even a random part repeats
    assert [i[3:17] for i in ids] == sorted(i[3:17] for i in ids)  # ids made in turn sort by time


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_reuses_its_parents_random_bits() -> None:
    new_operation_id()  # the pool now holds bytes the parent has not used yet
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then out without running the parent's cleanup
        os.write(write, new_operation_id().encode())
        os._exit(0)
    os.close(write)
    parents = new_operation_id()
    childs = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert ID.fullmatch(childs)
    assert childs[-18:] != parents[-18:]


async def test_a_claim_queued_behind_a_busy_writer_is_refused_once_the_file_left_its_path(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SQLiteLedger.open(path)
    try:
        held = await ledger.claim(request("held"), T0)  # the writer is idle: checked on this thread
        assert held.kind is ClaimKind.NEW
        release = threading.Event()
        busy = ledger._writer.submit(lambda conn: release.wait(10))  # the writer is busy from now on
        await asyncio.sleep(0.05)
        moved = tmp_path / "moved.db"
        path.rename(moved)

        # Both queue behind the busy writer and go in its next batch.
        done = Transition(
            State.SUCCEEDED, frozenset({State.RUNNING}), AuditEvent.SUCCEEDED, expect_fence=1,
            result=ToolResult([{"type": "text", "text": "ok"}], {"ok": True}),
        )  # fmt: skip
        claim = asyncio.ensure_future(ledger.claim(request("new"), T0 + 1))
        outcome = asyncio.ensure_future(ledger.update(held.operation.operation_id, done, T0 + 1))
        await asyncio.sleep(0.05)
        release.set()
        await busy

        with pytest.raises(LedgerUnavailable):
            await claim
        assert (await outcome) is not None  # the batch's other writes still ran

        moved.rename(path)  # back at its path (its WAL beside it): read it, and claims work again
        assert await ledger.get("alice", "s1", "new") is None  # nothing went into the moved file
        # An outcome of an effect that already happened is kept in the file its claim is in.
        kept = await ledger.get("alice", "s1", "held")
        assert kept is not None and kept.state is State.SUCCEEDED
        assert (await ledger.claim(request("after"), T0 + 2)).kind is ClaimKind.NEW
    finally:
        await ledger.close()
