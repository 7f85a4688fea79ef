"""Budgets meet approvals: a budgeted call that needs approval, and `exceeded = "approval"`.

A budgeted call that needs a person's approval is checked against its budget when it arrives, in
the claim that records it AWAITING_APPROVAL; while it waits it does not count, once approved it
does. With `exceeded = "approval"` a call past its budget is not refused: it waits for a person,
who reads the budget (name, limit, spent, amount) in the question, and the audit holds it too.
Ledger behaviour is checked on every backend; end to end through server processes in
test_budgets_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from support.boundary import FakeClock, SystemOfRecord, make_boundary
from test_budgets import LIMIT, budgeted, call, refused, spend, spending
from test_ledger_contract import T0, finish

from commitgate.server.core import approvals
from commitgate.server.core.requests import GuardedTool
from commitgate.server.ledger.base import BudgetCheck, ClaimKind, Lease, Ledger, OverBudget
from commitgate.server.model.amounts import amount as exact
from commitgate.server.model.facts import ApprovalState, ErrorCode, State
from commitgate.server.model.notes import ApprovalRecord, ErrorRecord
from commitgate.server.model.records import Operation
from commitgate.server.policy.models import ToolPolicy


def waiting_record(deciders: list[str] | None = None, now: float = T0) -> ApprovalRecord:
    return ApprovalRecord(
        ApprovalState.AWAITING,
        deciders=tuple(deciders or ["operator"]),
        requested_at=now,
        expires_at=now + 3600.0,
    )


ASK = dataclasses.replace(LIMIT, approval=waiting_record())  # exceeded = "approval"


async def approve(ledger: Ledger, operation_id: str, now: float = T0 + 1) -> Operation:
    decided = await approvals.decide(
        ledger, operation_id, "approve", by="anna", via="operator", reason="worth it", now=now
    )
    assert decided.state is State.PENDING
    return decided


async def take(
    ledger: Ledger, op: Operation, amount: float, now: float, check: BudgetCheck = LIMIT
) -> Operation:
    """The take of an approved operation, its budget checked with it (raises OverBudget: not taken)."""
    change = approvals.take_change(
        op, Lease("owner-b", now + 10), dataclasses.replace(check, amount=exact(amount))
    )
    taken = await ledger.update(op.operation_id, change, now, current=op)
    assert taken is not None and taken.state is State.RUNNING
    return taken


# --- the ledger (every backend) -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_call_past_its_budget_waits_for_a_person_with_the_budget_in_record_and_audit(
    ledger: Ledger,
) -> None:
    await spend(ledger, "k1", 800.0)
    claim = await ledger.claim(spending("k2", 400.0, check=ASK), T0)
    assert claim.kind is ClaimKind.AWAITING
    op = claim.operation
    assert op.state is State.AWAITING_APPROVAL and op.attempts == 0
    over = {"name": "payments", "limit": 1000, "spent": 800, "amount": 400}
    assert op.approval is not None and op.approval.over_budget is not None
    assert op.approval.over_budget.shown() == over
    assert op.approval.deciders == ("operator",) and op.approval.expires_at == T0 + 3600.0
    stored = await ledger.get("alice", "s1", "k2")
    assert stored is not None and stored.approval == op.approval
    events = {entry.event: entry for entry in await ledger.history(op.operation_id)}
    assert events["budget_exceeded"].detail == over
    assert events["approval_requested"].to_state == "AWAITING_APPROVAL"
    # a call that fits still runs at once; the same key again is the one waiting operation
    await spend(ledger, "k3", 200.0, check=ASK)
    again = await ledger.claim(spending("k2", 400.0, check=ASK), T0 + 1)
    assert again.kind is ClaimKind.EXISTING and again.operation.operation_id == op.operation_id


@pytest.mark.anyio
async def test_an_over_budget_wait_counts_once_approved_and_taken_and_never_if_denied(ledger: Ledger) -> None:
    await spend(ledger, "k1", 800.0)
    waiting = (await ledger.claim(spending("k2", 400.0, check=ASK), T0)).operation
    denied = (await ledger.claim(spending("k3", 300.0, check=ASK), T0)).operation
    assert denied.state is State.AWAITING_APPROVAL
    await approvals.decide(
        ledger, denied.operation_id, "deny", by="anna", via="operator", reason="no", now=T0
    )
    assert await refused(ledger, "k4", 201.0) == 800.0  # neither the waiting nor the denied one counts
    approved = await approve(ledger, waiting.operation_id)
    assert await refused(ledger, "k4", 201.0, now=T0 + 2) == 800.0  # approved, not yet run: not yet spent
    await take(ledger, approved, 400.0, T0 + 2)  # an approved overspend is not checked again at its take
    assert await refused(ledger, "k4", 1.0, now=T0 + 2) == 1200.0  # spent past the limit knowingly


@pytest.mark.anyio
async def test_a_retryable_operation_taken_again_past_its_budget_waits_instead(ledger: Ledger) -> None:
    first = await ledger.get_by_id(None, await spend(ledger, "k1", 600.0))
    assert first is not None
    assert await ledger.update(
        first.operation_id, finish(first, State.FAILED_RETRYABLE, error=ErrorRecord(message="busy")), T0
    )
    await spend(ledger, "k2", 600.0)
    claim = await ledger.claim(spending("k1", 600.0, check=ASK), T0 + 1)
    assert claim.kind is ClaimKind.AWAITING
    op = claim.operation
    assert op.operation_id == first.operation_id and op.state is State.AWAITING_APPROVAL
    assert op.approval is not None and op.approval.over_budget is not None
    assert op.approval.over_budget.spent == 600
    history = await ledger.history(op.operation_id)
    assert [(e.event, e.from_state, e.to_state) for e in history[-2:]] == [
        ("approval_requested", "FAILED_RETRYABLE", "AWAITING_APPROVAL"),
        ("budget_exceeded", None, "AWAITING_APPROVAL"),
    ]
    due = await approvals.expire_due(ledger, T0 + 3602)  # its wait is found by the sweep like any other
    assert [expired.operation_id for expired in due] == [op.operation_id]


@pytest.mark.anyio
async def test_a_budgeted_call_that_needs_approval_is_checked_on_arrival_and_again_when_taken(
    ledger: Ledger,
) -> None:
    await spend(ledger, "k1", 700.0)
    needs = dataclasses.replace(spending("k2", 400.0), approval=waiting_record())
    with pytest.raises(OverBudget) as over:  # exceeded = "reject": refused when it arrives
        await ledger.claim(needs, T0)
    assert over.value.spent == 700.0
    assert await ledger.get("alice", "s1", "k2") is None
    fits = dataclasses.replace(spending("k3", 300.0), approval=waiting_record())
    claim = await ledger.claim(fits, T0)
    assert claim.kind is ClaimKind.AWAITING and claim.operation.approval is not None
    assert claim.operation.approval.over_budget is None
    await spend(ledger, "k4", 300.0)  # waiting, it does not count: 700 + 300 fits
    approved = await approve(ledger, claim.operation.operation_id)
    with pytest.raises(OverBudget) as over:  # approved is not a blank cheque: no room when it is taken
        await take(ledger, approved, 300.0, T0 + 2)
    assert over.value.spent == 1000
    still = await ledger.get_by_id(None, approved.operation_id)
    assert still is not None and still.state is State.PENDING and still.attempts == 0


@pytest.mark.anyio
async def test_approved_operations_spend_when_taken_and_only_while_there_is_room(ledger: Ledger) -> None:
    """Five waiting charges of the whole limit, all approved: the first take spends, the others are refused."""
    needs = [dataclasses.replace(spending(f"w{i}", 1000.0), approval=waiting_record()) for i in range(5)]
    waiting = [(await ledger.claim(r, T0)).operation for r in needs]
    assert {op.state for op in waiting} == {State.AWAITING_APPROVAL}  # none counts while it waits
    approved = [await approve(ledger, op.operation_id) for op in waiting]
    results = await asyncio.gather(
        *(take(ledger, op, 1000.0, T0 + 2) for op in approved), return_exceptions=True
    )
    taken = [r for r in results if isinstance(r, Operation)]
    assert len(taken) == 1, results
    assert all(isinstance(r, OverBudget) and r.spent == 1000 for r in results if not isinstance(r, Operation))


@pytest.mark.anyio
async def test_the_take_not_the_creation_places_spending_in_the_window(ledger: Ledger) -> None:
    """Approved after the window is over, a charge still counts: from its take."""
    claim = await ledger.claim(dataclasses.replace(spending("late", 1000.0), approval=waiting_record()), T0)
    approved = await approve(ledger, claim.operation.operation_id, now=T0 + 3000)
    await take(ledger, approved, 1000.0, T0 + 3700)  # 3700 s after its creation, in a window of 3600 s
    assert await refused(ledger, "beside", 1000.0, now=T0 + 3701) == 1000
    (spent,) = await ledger.budget_spent("payments", "principal", T0 + 3701 - 3600, T0 + 3701)
    assert (spent.spent, spent.operations) == (1000, 1)


@pytest.mark.anyio
async def test_a_call_that_needs_approval_anyway_keeps_its_own_record_past_the_budget(ledger: Ledger) -> None:
    await spend(ledger, "k1", 800.0)
    own = waiting_record(["client"])
    claim = await ledger.claim(dataclasses.replace(spending("k2", 400.0, check=ASK), approval=own), T0)
    assert claim.kind is ClaimKind.AWAITING and claim.operation.approval is not None
    # its own timeout and prompt, but an overspend is an operator's to decide, never the client's
    assert claim.operation.approval.deciders == ("operator",)
    assert claim.operation.approval.over_budget is not None
    assert claim.operation.approval.over_budget.amount == 400


# --- the boundary: the policy's settings, the question, the answer -------------------------------------


def asking(record: SystemOfRecord, **tool_policy: Any) -> GuardedTool:
    tool, _ = budgeted(record, exceeded="approval")
    if tool_policy:
        document = {**tool.policy.model_dump(mode="json", exclude_none=True), **tool_policy}
        tool = dataclasses.replace(tool, policy=ToolPolicy.model_validate(document))
    return tool


@pytest.mark.anyio
async def test_a_call_past_its_budget_answers_approval_pending_runs_nothing_then_once_when_approved(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    tool = asking(record)
    clock = FakeClock(T0)
    boundary = make_boundary(ledger, [tool], clock=clock)
    assert (await boundary.call(call(tool, "k1", {"amount": 700}))).error is None
    answer = await boundary.call(call(tool, "k2", {"amount": 400}))
    assert answer.error is not None and answer.error.code is ErrorCode.APPROVAL_PENDING
    assert "would take budget 'payments' past its limit" in answer.error.message
    assert answer.operation is not None and answer.operation.state is State.AWAITING_APPROVAL
    assert record.count() == 1
    op = answer.operation
    assert op.approval is not None and op.approval.deciders == ("operator",)  # never the agent's client
    assert op.approval.expires_at == T0 + 24 * 3600
    text = approvals.question(op, tool.policy).text
    assert text.splitlines()[0] == "Approve this call of charge?"
    assert (
        "Over budget 'payments': this call spends 400, 700 of 1000 is already spent in its window, "
        "so 300 is left; approving spends past the limit." in text
    )
    assert approvals.status(op) == {
        "state": "awaiting", "by": None, "via": None, "reason": None, "decided_at": None,
        "expires_at": approvals.status(op)["expires_at"],  # type: ignore[index]
        "over_budget": {"name": "payments", "limit": 1000, "spent": 700, "amount": 400},
    }  # fmt: skip
    await approve(ledger, op.operation_id, now=clock())
    assert (await boundary.call(call(tool, "k2", {"amount": 400}))).error is None
    replay = await boundary.call(call(tool, "k2", {"amount": 400}))
    assert replay.replayed and record.count() == 2


@pytest.mark.anyio
async def test_the_tools_own_approval_settings_apply_past_the_budget(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    tool = asking(
        record,
        approval={
            "when": "false",
            "timeout": "2h",
            "via": ["operator"],
            "prompt": "Charge {arguments.amount}?",
        },
    )
    boundary = make_boundary(ledger, [tool], clock=FakeClock(T0))
    assert (await boundary.call(call(tool, "k1", {"amount": 900}))).error is None  # `when` is false
    answer = await boundary.call(call(tool, "k2", {"amount": 200}))
    assert answer.error is not None and answer.error.code is ErrorCode.APPROVAL_PENDING
    op = answer.operation
    assert op is not None and op.approval is not None
    assert op.approval.deciders == ("operator",) and op.approval.expires_at == T0 + 7200
    text = approvals.question(op, tool.policy).text
    assert text.startswith("Charge 200?") and "Over budget 'payments'" in text
    assert record.count() == 1


def test_exceeded_approval_loads() -> None:
    from test_budgets import POLICY

    from commitgate.server.policy.loading import loads_policy

    policy = loads_policy(POLICY.replace('per = "principal"', 'per = "principal"\nexceeded = "approval"'))
    assert policy.budgets["payments"].exceeded == "approval"
