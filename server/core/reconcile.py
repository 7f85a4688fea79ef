"""Reconciliation: asking a tool's status check whether an operation of unknown outcome happened.

The verdict (found, not found, cannot tell) and the note kept with the operation come from here,
and so do the transitions each verdict records; the boundary decides when to ask and what
follows (docs/contract.md#operation-states).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from commitgate.server.core.requests import GuardedTool
from commitgate.server.ledger.base import Transition
from commitgate.server.model.audit import COMMITGATE, AuditEvent
from commitgate.server.model.context import OperationContext
from commitgate.server.model.events import BoundaryEvent, Event
from commitgate.server.model.facts import State
from commitgate.server.model.notes import ErrorRecord, ReconciliationNote
from commitgate.server.model.outcomes import Outcome, Verdict
from commitgate.server.model.records import Operation, ToolResult

Check = tuple[Verdict, ToolResult | None, ReconciliationNote]  # the verdict, what was found, the note


async def status_check(
    tool: GuardedTool,
    op: Operation,
    now: float,
    tell: Callable[[BoundaryEvent], None],
    attempt: int | None = None,
) -> Check:
    """Ask `tool`'s status check about `op` (under the tool's timeout); a failing check cannot tell.
    Observers are told the verdict here, inside the check's span."""
    ctx = OperationContext(
        op.step, op.session, op.operation_id, attempt or op.attempts, op.principal, tool.name
    )
    found: ToolResult | None = None
    try:
        async with asyncio.timeout(tool.policy.timeout):
            found = await tool.source.status(op.arguments, ctx)
    except Exception as exc:
        verdict = Verdict.CANNOT_TELL
        note = ReconciliationNote("status_check", now, verdict.value, error=str(exc) or type(exc).__name__)
    else:
        verdict = Verdict.NOT_FOUND if found is None else Verdict.FOUND
        note = ReconciliationNote("status_check", now, verdict.value)
    tell(
        BoundaryEvent(
            Event.RECONCILIATION, tool.name, tool.idempotency_class, op.operation_id, verdict=verdict
        )
    )
    return verdict, found, note


def found(result: ToolResult | None, note: ReconciliationNote) -> Transition:
    """It happened: SUCCEEDED with what the check found."""
    return Transition(
        State.SUCCEEDED,
        frozenset({State.UNKNOWN}),
        AuditEvent.RECONCILED_FOUND,
        result=result,
        reconciliation=note,
        actor=COMMITGATE,  # a status check of its own
    )


def not_found(op: Operation, note: ReconciliationNote) -> Transition:
    """No trace of it: FAILED_RETRYABLE, for the attempts up to the one checked only."""
    return Transition(
        State.FAILED_RETRYABLE,
        frozenset({State.UNKNOWN}),
        AuditEvent.RECONCILED_NOT_FOUND,
        expect_fence=op.fence,  # the check covered attempts up to this one only
        reconciliation=note,
        error=ErrorRecord(outcome=Outcome.RETRYABLE.value, message="the status check found no trace of it"),
        actor=COMMITGATE,  # a status check of its own
    )


def undecided(note: ReconciliationNote) -> Transition:
    """The check could not tell: still UNKNOWN, with the note of this try."""
    return Transition(
        State.UNKNOWN,
        frozenset({State.UNKNOWN}),
        AuditEvent.RECONCILE_UNDECIDED,
        reconciliation=note,
        actor=COMMITGATE,  # a status check of its own
    )
