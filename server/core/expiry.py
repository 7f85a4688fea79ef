"""Expiring what a read touches (docs/contract.md#leases): the one rule every reader follows.

A RUNNING operation whose lease ran out (or whose owner is known to be gone) turns UNKNOWN, and a
wait for approval past its timeout turns FAILED_FINAL (approval_expired), at the next touch: a
call, a poll, `list_operations`, `commitgate ops list`, a console page, or the server's sweep. Each
move is one ledger transition, written once whoever touches first; the others read it back.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

from commitgate.server.core import approvals
from commitgate.server.ledger.base import LEASE_LOST, Ledger, OperationFilter, Transition, lease_over
from commitgate.server.model.audit import COMMITGATE, AuditEvent
from commitgate.server.model.events import BoundaryEvent, Event
from commitgate.server.model.facts import State
from commitgate.server.model.records import Operation

Tell = Callable[[BoundaryEvent], None]
"""Where a move is told (the boundary's observers); None: a reader with nobody listening."""

_LOOK_LIMIT = 1000


def due(op: Operation, now: float) -> bool:
    """A touch at `now` would move `op`."""
    return lease_over(op, now) or approvals.due(op, now)


async def touch(
    ledger: Ledger, op: Operation, now: float, tell: Tell | None = None, running: Container[str] = ()
) -> Operation:
    """`op` as a touch at `now` leaves it. `running`: the operations this process is running
    itself; their lease is renewed while they run, so a lapse seen here is not an owner gone."""
    if op.state is State.AWAITING_APPROVAL:
        return await expire_approval(ledger, op, now, tell)
    if lease_over(op, now) and op.operation_id not in running:
        return await expire_lease(ledger, op, now, tell)
    return op


async def touch_all(
    ledger: Ledger,
    ops: Iterable[Operation],
    now: float,
    tell: Tell | None = None,
    running: Container[str] = (),
) -> list[Operation]:
    """A listing is a touch of each operation it shows."""
    return [await touch(ledger, op, now, tell, running) for op in ops]


async def expire_lease(ledger: Ledger, op: Operation, now: float, tell: Tell | None = None) -> Operation:
    """A RUNNING operation whose owner can no longer record its outcome: UNKNOWN (lease_expired)."""
    change = Transition(
        State.UNKNOWN,
        frozenset({State.RUNNING}),
        AuditEvent.LEASE_EXPIRED,
        expect_fence=op.fence,
        error=LEASE_LOST,
        actor=COMMITGATE,
    )
    expired = await ledger.update(op.operation_id, change, now)
    if expired is None:  # moved meanwhile (recorded, or expired by another reader): what it is now
        return await ledger.get_by_id(op.principal, op.operation_id) or op
    _told(tell, Event.LEASE_EXPIRED, op)
    return expired


async def expire_approval(ledger: Ledger, op: Operation, now: float, tell: Tell | None = None) -> Operation:
    """A wait for approval past its timeout: FAILED_FINAL (approval_expired); any other, as it is."""
    current, moved = await approvals.touch(ledger, op, now)
    if moved:
        _told(tell, Event.APPROVAL_EXPIRED, op)
    return current


async def sweep(ledger: Ledger, now: float, tell: Tell | None = None, *, look_first: bool = False) -> None:
    """Every operation due at `now`, moved: the server's periodic sweep, and a console listing.
    `look_first`: write only when a lease is due (a reader that should not write for nothing)."""
    if look_first:
        running = await ledger.find(OperationFilter(None, state=State.RUNNING, limit=_LOOK_LIMIT))
        expired = await ledger.expire_leases(now) if any(lease_over(op, now) for op in running) else []
    else:
        expired = await ledger.expire_leases(now)
    for op in expired:
        _told(tell, Event.LEASE_EXPIRED, op)
    for op in await approvals.expire_due(ledger, now):
        _told(tell, Event.APPROVAL_EXPIRED, op)


def _told(tell: Tell | None, kind: Event, op: Operation) -> None:
    if tell is not None:
        tell(BoundaryEvent(kind, op.tool, op.idempotency_class, operation_id=op.operation_id))
