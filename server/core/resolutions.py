"""An operator's resolution of an `UNKNOWN` operation, recorded the same way from every front end.

`commitgate ops resolve` and the console both call `resolve`: a person checked the system of
record and says whether the action took effect. The decision is one compare-and-set from
`UNKNOWN` (a later retry of the same key replays it), with who decided and why in the audit
trail and in the operation's `reconciliation` (docs/contract.md#operation-states).
"""

from __future__ import annotations

import getpass
import json
from dataclasses import dataclass
from enum import StrEnum

from commitgate.server.ledger.base import Ledger, Transition, lease_over
from commitgate.server.model.audit import COMMITGATE, Actor, AuditEvent
from commitgate.server.model.errors import UserFacingError
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ErrorRecord, ReconciliationNote
from commitgate.server.model.records import Operation, ToolResult


class Finding(StrEnum):
    """What the operator found in the system of record."""

    SUCCEEDED = "succeeded"  # it took effect: later retries replay the result
    FAILED = "failed"  # it did not take effect, and must not run again (FAILED_FINAL)
    FAILED_RETRYABLE = "failed-retryable"  # it certainly did not happen: the same key may run again


class ResolutionError(UserFacingError):
    """A resolution that cannot be recorded. `field` names the input at fault (None: the operation)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Resolution:
    finding: Finding
    by: str
    reason: str | None = None
    result_json: str | None = None  # succeeded only: the tool's result, replayed to later retries


def local_operator() -> str:
    """Who resolves when no name is given: the OS user (one stable name even without a passwd entry)."""
    try:
        return getpass.getuser()
    except Exception:
        return "local"


def names_its_agent(by: str, op: Operation) -> str | None:
    """Why `by` may not be recorded as the operator deciding `op`, or None. A decision taken as an
    operator names a person, never the agent it is about: on stdio the agent's principal is the OS
    user, which is also who decides when no name is given."""
    if by != op.principal:
        return None
    return (
        f"{by!r} is the principal of the agent that made {op.operation_id}: a decision is recorded as"
        " the person who takes it, never as that agent; decide under your own name"
        " (`commitgate ops ... --by NAME`, `commitgate console --as NAME`)"
    )


def note_for(op: Operation, resolution: Resolution) -> str | None:
    """A warning worth showing before recording, or None."""
    if (
        resolution.finding is Finding.SUCCEEDED
        and not resolution.result_json
        and op.idempotency_class is IdempotencyClass.COMPENSABLE
    ):
        return "no result given: a compensation that refers to {result.X} will not find it"
    return None


def transition(resolution: Resolution, now: float) -> Transition:
    """The ledger change for `resolution`; ResolutionError when the inputs do not make one."""
    reason = (resolution.reason or "").strip() or None
    by = resolution.by
    if resolution.finding is Finding.SUCCEEDED:
        reason = reason or "an operator confirmed it took effect"
        note = ReconciliationNote("operator", now, "succeeded", operator=by, reason=reason)
        return Transition(
            State.SUCCEEDED,
            frozenset({State.UNKNOWN}),
            AuditEvent.RESOLVED,
            result=_result(resolution.result_json, by, reason),
            reconciliation=note,
            actor=Actor.operator(by),
            detail={"resolution": "succeeded", "reason": reason},
        )
    if reason is None:
        raise ResolutionError(
            "a failed outcome needs a reason: say what you found in the system of record", "reason"
        )
    if resolution.result_json:
        raise ResolutionError("a result goes only with a succeeded outcome", "result")
    retryable = resolution.finding is Finding.FAILED_RETRYABLE
    state = State.FAILED_RETRYABLE if retryable else State.FAILED_FINAL
    error = ErrorRecord(
        outcome="retryable" if retryable else "permanent",
        type="OperatorResolution",
        message=f"{reason} (resolved by {by})",
    )
    note = ReconciliationNote("operator", now, "failed", operator=by, reason=reason)
    return Transition(
        state,
        frozenset({State.UNKNOWN}),
        AuditEvent.RESOLVED,
        error=error,
        reconciliation=note,
        actor=Actor.operator(by),
        detail={"resolution": state.value, "reason": reason},
    )


def _result(text: str | None, by: str, reason: str) -> ToolResult:
    if not text or not text.strip():
        return ToolResult.of({"resolved": "succeeded", "by": by, "reason": reason})
    try:
        return ToolResult.of(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ResolutionError(f"the result is not valid JSON: {exc}", "result") from None


async def current(ledger: Ledger, operation_id: str, now: float, principal: str | None = None) -> Operation:
    """The operation as a resolution sees it: a RUNNING one whose owner is gone is UNKNOWN at this
    touch (docs/contract.md#leases). `principal` None: an operator who sees every principal."""
    op = await ledger.get_by_id(principal, operation_id)
    if op is None:
        raise ResolutionError(f"no operation {operation_id} in the ledger (purged, or a typo?)")
    if not lease_over(op, now):
        return op
    change = Transition(
        State.UNKNOWN,
        frozenset({State.RUNNING}),
        AuditEvent.LEASE_EXPIRED,
        expect_fence=op.fence,
        error=ErrorRecord(
            code="lease_expired", message="the process running this operation stopped answering"
        ),
        actor=COMMITGATE,
    )
    return await ledger.update(op.operation_id, change, now) or await _reread(ledger, op, principal)


async def _reread(ledger: Ledger, op: Operation, principal: str | None) -> Operation:
    again = await ledger.get_by_id(principal, op.operation_id)
    if again is None:
        raise ResolutionError(f"no operation {op.operation_id} in the ledger (purged, or a typo?)")
    return again


async def resolve(
    ledger: Ledger, operation_id: str, resolution: Resolution, now: float, principal: str | None = None
) -> Operation:
    """Record `resolution` on an UNKNOWN operation and return it resolved; ResolutionError says why not.
    Bad inputs are refused before the ledger is touched."""
    change = transition(resolution, now)
    op = await current(ledger, operation_id, now, principal)
    refusal = names_its_agent(resolution.by, op)
    if refusal is not None:
        raise ResolutionError(refusal)
    if op.state is not State.UNKNOWN:
        raise ResolutionError(
            f"{op.operation_id} is {op.state.value}: only UNKNOWN operations are resolved by hand"
        )
    resolved = await ledger.update(op.operation_id, change, now)
    if resolved is None:
        raise ResolutionError(f"{op.operation_id} changed meanwhile; look at it again before resolving")
    return resolved
