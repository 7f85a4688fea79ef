"""Approvals: a person says yes before the effect (docs/contract.md#approvals).

A keyed tool with `approval` in the policy asks its `when` expression about each new call; a
call that needs approval is recorded AWAITING_APPROVAL (no attempt, no effect) and runs only
after a decision: approved -> PENDING, which the next call with the same key and arguments (or
the call still held) takes and executes once; denied or not decided within `timeout` ->
FAILED_FINAL with `approval_denied` / `approval_expired`.

Every way of deciding (the client's user asked within the call, `commitgate ops approve|deny`,
a console) goes through `decide`, so the rules are the same for all: only an operation still
awaiting can be decided, only once, only by a decider its policy lists, and a principal-scoped
caller only for its own operations.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from commitgate.server.core.resolutions import names_its_agent
from commitgate.server.ledger.base import BudgetCheck, Lease, Ledger, OperationFilter, Transition
from commitgate.server.model.amounts import left, with_unit
from commitgate.server.model.audit import COMMITGATE, Actor, AuditEvent
from commitgate.server.model.facts import REFERENCE, ApprovalState, ErrorCode, State
from commitgate.server.model.notes import ApprovalRecord, BudgetFigures, ErrorRecord
from commitgate.server.model.records import Operation, iso
from commitgate.server.policy.approvals import ApprovalPolicy, Decider
from commitgate.server.policy.expressions import ExpressionFailed, activation
from commitgate.server.policy.masking import mask_values
from commitgate.server.policy.models import ToolPolicy

log = logging.getLogger("commitgate.approvals")

Decision = Literal["approve", "deny"]

_SWEEP_BATCH = 500


class ApprovalRefused(Exception):
    """A decision that cannot be taken: says why (its state, who decided, who may decide)."""


@dataclass(frozen=True, slots=True)
class Question:
    """What a person is asked: the rendered prompt and the call it is about."""

    operation_id: str
    tool: str
    principal: str
    text: str


def requirement(
    policy: ToolPolicy,
    arguments: Mapping[str, Any],
    principal: str,
    session: str,
    tool: str,
    now: float,
) -> ApprovalRecord | None:
    """The approval record a new call starts with, or None when it needs no approval.

    An expression that cannot be evaluated for this call (a missing argument, a wrong type)
    requires approval: a person looks rather than the gate guessing.
    """
    approval = policy.approval
    if approval is None:
        return None
    try:
        needed = approval.when.evaluate(activation(arguments, principal, session, tool)) is True
    except ExpressionFailed as exc:
        log.warning("%s: approval.when could not be evaluated, so approval is required: %s", tool, exc)
        return record(approval, now, reason=f"approval.when failed: {exc}")
    return record(approval, now) if needed else None


def record(
    approval: ApprovalPolicy, now: float, *, duplicate_of: str | None = None, reason: str | None = None
) -> ApprovalRecord:
    """The approval record of an operation that waits for a decision."""
    return ApprovalRecord(
        ApprovalState.AWAITING,
        deciders=tuple(approval.via),  # who may decide; `via` says, once decided, who did
        requested_at=now,
        expires_at=now + approval.timeout,
        duplicate_of=duplicate_of,
        required_because=reason,
    )


OPERATOR_ONLY: list[Decider] = ["operator"]


def duplicate_settings(policy: ToolPolicy) -> ApprovalPolicy:
    """How a suspected duplicate waits (`duplicates = {action = "approval"}`): as the tool's own
    `approval` says, or else decided by operators only: the agent's client never clears its own repeat."""
    return policy.approval or ApprovalPolicy(via=OPERATOR_ONLY)


def overrun_settings(policy: ToolPolicy) -> ApprovalPolicy:
    """How a call past its budget waits (`exceeded = "approval"`): the tool's timeout and prompt, but
    decided by operators only, whatever its `via`: the agent's client never lifts its own cap."""
    own = policy.approval or ApprovalPolicy()
    return own.model_copy(update={"via": OPERATOR_ONLY})


def due(op: Operation, now: float) -> bool:
    """An operation whose wait for a decision has run out."""
    if op.state is not State.AWAITING_APPROVAL or op.approval is None:
        return False
    expires_at = op.approval.expires_at
    return expires_at is not None and expires_at <= now


# --- the transitions ------------------------------------------------------------------------------


def _decided(
    op: Operation, state: ApprovalState, by: str | None, via: str, reason: str | None, now: float
) -> ApprovalRecord:
    asked = op.approval if op.approval is not None else ApprovalRecord(ApprovalState.AWAITING)
    return asked.decided(state, by, via, reason, now)


def approve_change(op: Operation, by: str, via: str, reason: str | None, now: float) -> Transition:
    return Transition(
        State.PENDING,
        frozenset({State.AWAITING_APPROVAL}),
        AuditEvent.APPROVED,
        expect_fence=op.fence,
        approval=_decided(op, ApprovalState.APPROVED, by, via, reason, now),
        actor=Actor.operator(by),
        detail={"via": via, "reason": reason},
    )


def deny_change(op: Operation, by: str, via: str, reason: str | None, now: float) -> Transition:
    why = f": {reason}" if reason else ""
    return Transition(
        State.FAILED_FINAL,
        frozenset({State.AWAITING_APPROVAL}),
        AuditEvent.DENIED,
        expect_fence=op.fence,
        error=ErrorRecord(code=ErrorCode.APPROVAL_DENIED.value, message=f"denied by {by} ({via}){why}"),
        approval=_decided(op, ApprovalState.DENIED, by, via, reason, now),
        actor=Actor.operator(by),
        detail={"via": via, "reason": reason},
    )


def expire_change(op: Operation, now: float) -> Transition:
    expires_at = op.approval.expires_at if op.approval is not None else None
    before = iso(expires_at) if expires_at is not None else "its timeout"
    return Transition(
        State.FAILED_FINAL,
        frozenset({State.AWAITING_APPROVAL}),
        AuditEvent.APPROVAL_EXPIRED,
        expect_fence=op.fence,
        error=ErrorRecord(
            code=ErrorCode.APPROVAL_EXPIRED.value, message=f"nobody approved it before {before}"
        ),
        approval=_decided(op, ApprovalState.EXPIRED, None, "timeout", None, now),
        actor=COMMITGATE,
    )


def take_change(op: Operation, lease: Lease, budget: BudgetCheck | None = None) -> Transition:
    """An approved operation taken by the call that executes it: its first attempt, exactly once.
    `budget`: the tool's budget, checked again with the take (a PENDING operation has not spent yet)."""
    return Transition(
        State.RUNNING,
        frozenset({State.PENDING}),
        AuditEvent.APPROVED_CLAIMED,
        expect_fence=op.fence,
        lease=lease,
        actor=Actor.principal(op.principal),
        budget=budget,
    )


# --- deciding ---------------------------------------------------------------------------------------


async def expire(ledger: Ledger, op: Operation, now: float) -> tuple[Operation, bool]:
    """`op` after its wait ran out (FAILED_FINAL, approval_expired); True when this call moved it."""
    moved = await ledger.update(op.operation_id, expire_change(op, now), now)
    if moved is not None:
        return moved, True
    return (await ledger.get_by_id(None, op.operation_id)) or op, False


async def touch(ledger: Ledger, op: Operation, now: float) -> tuple[Operation, bool]:
    """Every touch enforces the timeout: an operation past it expires now, not at the next sweep."""
    if due(op, now):
        return await expire(ledger, op, now)
    return op, False


async def expire_due(ledger: Ledger, now: float) -> list[Operation]:
    """The periodic sweep: every operation whose wait ran out becomes FAILED_FINAL (approval_expired)."""
    expired: list[Operation] = []
    while True:
        where = OperationFilter(None, state=State.AWAITING_APPROVAL, approval_due_by=now, limit=_SWEEP_BATCH)
        batch = await ledger.find(where)
        moved = 0
        for op in batch:
            if due(op, now):
                current, mine = await expire(ledger, op, now)
                moved += current.state is not State.AWAITING_APPROVAL
                if mine:
                    expired.append(current)
        if len(batch) < _SWEEP_BATCH or moved == 0:  # all of them, or nothing more will move
            return expired


async def decide(
    ledger: Ledger,
    operation_id: str,
    decision: Decision,
    *,
    by: str,
    via: str,
    reason: str | None,
    now: float,
    principal: str | None = None,
) -> Operation:
    """Approve or deny one operation; raise ApprovalRefused saying why when it cannot be decided.

    `principal`: the caller sees only that principal's operations (None: an operator's CLI).
    """
    op = await ledger.get_by_id(principal, operation_id)
    if op is None:
        raise ApprovalRefused(f"no operation {operation_id!r}" + (" visible to you" if principal else ""))
    op, _ = await touch(ledger, op, now)
    refusal = _refusal(op, via) or (names_its_agent(by, op) if via == "operator" else None)
    if refusal is not None:
        raise ApprovalRefused(refusal)
    change = (approve_change if decision == "approve" else deny_change)(op, by, via, reason, now)
    decided = await ledger.update(op.operation_id, change, now)
    if decided is None:  # someone else decided (or the wait ran out) in the meantime
        current = await ledger.get_by_id(None, op.operation_id) or op
        raise ApprovalRefused(_refusal(current, via) or f"{op.operation_id} changed meanwhile; look again")
    log.info("%s %s by %s via %s", op.operation_id, decided.state.value, by, via)
    return decided


def _refusal(op: Operation, via: str) -> str | None:
    approval = op.approval
    if op.state is not State.AWAITING_APPROVAL:
        decided = approval.state if approval is not None else None
        if approval is not None and decided in (ApprovalState.APPROVED, ApprovalState.DENIED):
            when = iso(approval.decided_at) if approval.decided_at is not None else "earlier"
            return (
                f"{op.operation_id} was already {approval.state.value} by {approval.by} "
                f"({approval.via}) at {when}; it is now {op.state.value}. A decision is taken once."
            )
        if decided is ApprovalState.EXPIRED:
            return f"{op.operation_id} is not awaiting approval: nobody decided before its timeout, it is {op.state.value}"
        return f"{op.operation_id} is not awaiting approval: it is {op.state.value}"
    allowed = approval.deciders if approval is not None else ()
    if via not in allowed:
        return f"{op.operation_id} may be decided only via {', '.join(allowed)}, not via {via}"
    return None


# --- what a person is shown ---------------------------------------------------------------------


def masked(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments as a person may see them, by the same rules as every screen: credentials
    hidden, card numbers cut to their last four digits."""
    shown: dict[str, Any] = mask_values(dict(arguments))
    return shown


def render_prompt(template: str, arguments: Mapping[str, Any]) -> str:
    """`{arguments.X}` filled from the masked arguments (a secret stays masked even when named)."""
    shown = masked(arguments)

    def value_of(match: re.Match[str]) -> str:
        if match.group(1) != "arguments":
            return match.group(0)
        node: Any = shown
        for part in match.group(2).split(".")[1:]:
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return match.group(0)
        return node if isinstance(node, str) else json.dumps(node, ensure_ascii=False, default=str)

    return REFERENCE.sub(value_of, template)


def question(
    op: Operation,
    policy: ToolPolicy | None,
    earlier: Operation | None = None,
    budget: BudgetFigures | None = None,
) -> Question:
    """The text a person reads before deciding: the prompt, the tool, the arguments (masked), who asks,
    and for a budgeted call its budget (`budget`: its figures as things stand)."""
    template = policy.approval.prompt if policy is not None and policy.approval is not None else None
    lines = [render_prompt(template, op.arguments) if template else f"Approve this call of {op.tool}?"]
    lines.append(f"Tool: {op.tool}")
    lines.append(f"Arguments: {json.dumps(masked(op.arguments), ensure_ascii=False, default=str)}")
    lines.append(f"Requested by: {op.principal} (session {op.session!r}, idempotency_key {op.step!r})")
    if earlier is not None:
        lines.append(
            f"Possible duplicate of {earlier.operation_id} (idempotency_key {earlier.step!r}, "
            f"{earlier.state.value}, created {iso(earlier.created_at)}) with exactly these arguments."
        )
    over = over_budget(op)
    if over is not None:
        lines.append(over_budget_text(over))
    elif budget is not None:
        lines.append(budget_text(budget))
    lines.append(f"Operation: {op.operation_id}")
    return Question(op.operation_id, op.tool, op.principal, "\n".join(lines))


def status(op: Operation) -> dict[str, Any] | None:
    """The status view's `approval = {state, by, via, reason, decided_at}` (with when the wait ends)."""
    approval = op.approval
    if approval is None:
        return None
    view: dict[str, Any] = {
        "state": approval.state.value,
        "by": approval.by,
        "via": approval.via,
        "reason": approval.reason,
        "decided_at": iso(approval.decided_at),
    }
    if approval.state is ApprovalState.AWAITING and approval.expires_at is not None:
        view["expires_at"] = iso(approval.expires_at)
    if approval.duplicate_of:
        view["duplicate_of"] = approval.duplicate_of
    over = over_budget(op)
    if over is not None:
        view["over_budget"] = over.shown()
    return view


def over_budget(op: Operation) -> BudgetFigures | None:
    """The figures of the budget an operation waits past (`exceeded = "approval"`)."""
    return op.approval.over_budget if op.approval is not None else None


def over_budget_text(over: BudgetFigures) -> str:
    """One line for the person deciding: approving spends past the budget's limit."""
    unit = over.unit
    return (
        f"Over budget {over.name!r}: this call spends {with_unit(over.amount, unit)}, "
        f"{with_unit(over.spent, unit)} of {with_unit(over.limit, unit)} is already spent in its window, so "
        f"{with_unit(left(over.limit, over.spent), unit)} is left; approving spends past the limit."
    )


def budget_text(figures: BudgetFigures) -> str:
    """One line for the person deciding a budgeted call that fits as things stand: the budget's figures.
    Approving does not reserve them: the budget is checked again when the call is taken to run."""
    limit, spent, unit = figures.limit, figures.spent, figures.unit
    return (
        f"Budget {figures.name!r}: limit {with_unit(limit, unit)}, spent {with_unit(spent, unit)}, left "
        f"{with_unit(left(limit, spent), unit)}; this call spends {with_unit(figures.amount, unit)}. "
        "It is checked again when it runs: if the budget has no room left then, it is refused."
    )
