"""Budgets: caps on what the calls of some tools may spend within a sliding window.

A keyed tool with `budget = "NAME"` spends, per call, what the budget's CEL `amount` gives for
the call's arguments. The ledger adds up the amounts of the budget's recent operations in scope
and claims the call only when its amount still fits the limit (`BudgetCheck`): the sum and the
insert are one atomic step, so concurrent calls can never jointly overspend.

Here: the amount of one call (refused when it is not a number), the claim's check, and the
answer the model reads. The contract: docs/contract.md#budgets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from commitgate.server.core import approvals, errors
from commitgate.server.core.errors import GateError
from commitgate.server.ledger.base import BudgetCheck, Ledger, SpentIn, scope_name, scope_of
from commitgate.server.model.amounts import ZERO, NotAnAmount, left, number, with_unit
from commitgate.server.model.amounts import amount as exact
from commitgate.server.model.durations import format_duration
from commitgate.server.model.notes import BudgetFigures
from commitgate.server.model.records import Operation
from commitgate.server.policy.budgets import BudgetPolicy
from commitgate.server.policy.expressions import ExpressionFailed, activation
from commitgate.server.policy.models import Policy, ToolPolicy


@dataclass(frozen=True, slots=True)
class Budget:
    """A declared budget with its name, as a tool that spends from it carries it."""

    name: str
    policy: BudgetPolicy


def amount_of(budget: Budget, arguments: dict[str, Any], principal: str, session: str, tool: str) -> Decimal:
    """What this call spends: the budget's `amount` for it, a finite number >= 0, as an exact decimal.

    Anything else refuses the call (`invalid_arguments`): counting it as zero would let an
    unexpected argument spend without limit.
    """
    expression = budget.policy.amount
    try:
        value = expression.evaluate(activation(arguments, principal, session, tool))
    except ExpressionFailed as exc:
        raise errors.invalid_arguments(
            f"budget {budget.name!r} could not work out what this call spends: {exc}"
        ) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise errors.invalid_arguments(
            f"budget {budget.name!r} needs a number for what this call spends, but {expression.source!r} "
            f"gave {_shown(value)}; pass the amount as a number"
        )
    if not math.isfinite(value) or value < 0:
        raise errors.invalid_arguments(
            f"budget {budget.name!r}: what this call spends ({expression.source!r}) must be a finite number "
            f">= 0, got {value!r}"
        )
    try:
        return exact(value)
    except NotAnAmount as exc:
        raise errors.invalid_arguments(
            f"budget {budget.name!r}: what this call spends ({expression.source!r}) {exc}"
        ) from None


def _shown(value: Any) -> str:
    text = repr(value)
    kind = type(value).__name__
    return f"{text[:40]}{'...' if len(text) > 40 else ''} ({kind})"


def check_for(budget: Budget, amount: Decimal, tool: ToolPolicy, now: float) -> BudgetCheck:
    """The claim's (and the take's) check. With `exceeded = "approval"` it carries the approval record
    a call that does not fit waits with: the tool's own timeout, decided by operators only."""
    policy = budget.policy
    waits = approvals.record(approvals.overrun_settings(tool), now) if policy.exceeded == "approval" else None
    return BudgetCheck(budget.name, policy.per, amount, policy.limit, policy.window, waits, policy.unit)


def exceeded(
    budget: Budget, amount: Decimal, spent: Decimal, principal: str, session: str, *, recorded: bool = False
) -> GateError:
    """`budget_exceeded`: what the call would have spent, what is spent already, and what to do.
    `recorded`: the operation was approved and refused when taken to run (it stays FAILED_FINAL)."""
    policy = budget.policy
    scope = {
        "principal": f"for principal {principal!r}",
        "session": f"for session {session!r} of principal {principal!r}",
        "all": "for all callers together",
    }[policy.per]
    shown: dict[str, Any] = {
        "name": budget.name,
        "limit": number(policy.limit),
        "spent": number(spent),
        "window": format_duration(policy.window),
    }
    if policy.unit:
        shown["unit"] = policy.unit
    figures = {
        "amount": with_unit(amount, policy.unit),
        "limit": with_unit(policy.limit, policy.unit),
        "spent": with_unit(spent, policy.unit),
        "left": with_unit(left(policy.limit, spent), policy.unit),
    }
    return errors.budget_exceeded(shown, figures, scope, recorded=recorded)


async def standing(ledger: Ledger, budget: Budget | None, op: Operation, now: float) -> BudgetFigures | None:
    """The figures a person deciding a budgeted call reads: what its scope has spent within the window now. None: no budget, or the call waits past it already
    (its record carries the figures it was sent to a person with)."""
    if budget is None or approvals.over_budget(op) is not None:
        return None
    try:
        spends = amount_of(budget, op.arguments, op.principal, op.session, op.tool)
    except GateError:
        return None
    policy = budget.policy
    principal, session = scope_of(policy.per, op.principal, op.session)
    spans = await ledger.budget_spending(
        budget.name, principal, session, now - policy.window, now, policy.window
    )
    spent = sum((s.spent for s in spans), ZERO)
    return BudgetFigures(budget.name, policy.limit, spent, spends, policy.unit or None)


def scope_label(budget: Budget, principal: str, session: str) -> str:
    """The scope a call spends in, as `ops budgets` and the metrics name it."""
    return scope_name(*scope_of(budget.policy.per, principal, session))


async def budget_report(ledger: Ledger, policy: Policy, now: float) -> list[dict[str, Any]]:
    """Each budget of the policy: its settings, its tools, and what each scope spent within the window,
    highest first (what `commitgate ops budgets` prints and the console's Budgets page shows)."""
    report = []
    for name, budget in policy.budgets.items():
        spent = await ledger.budget_spent(name, budget.per, now - budget.window, now)
        report.append(
            {
                "name": name,
                "amount": budget.amount.source,
                "limit": number(budget.limit),
                "unit": budget.unit,
                "window": format_duration(budget.window),
                "per": budget.per,
                "exceeded": budget.exceeded,
                "tools": [tool for tool, p in policy.tools.items() if p.budget == name],
                "scopes": [
                    {
                        "scope": s.scope,
                        "principal": s.principal,
                        "session": s.session,
                        "spent": number(s.spent),
                        "left": number(left(budget.limit, s.spent)),
                        "operations": s.operations,
                    }
                    for s in spent
                ],
            }
        )
    return report


# Span lengths a spending chart may use, shortest first: the shortest giving at most MAX_SPANS spans.
SPAN_LENGTHS = (60.0, 300.0, 900.0, 3600.0, 3 * 3600.0, 6 * 3600.0, 86400.0, 7 * 86400.0, 30 * 86400.0)
MAX_SPANS = 48


def span_for(window: float) -> float:
    """How long each span of a spending chart over `window` is: whole minutes, hours or days."""
    for length in SPAN_LENGTHS:
        if window / length <= MAX_SPANS:
            return length
    return math.ceil(window / MAX_SPANS / SPAN_LENGTHS[-1]) * SPAN_LENGTHS[-1]


async def spending_over_window(
    ledger: Ledger, name: str, budget: BudgetPolicy, principal: str | None, session: str | None, now: float
) -> list[SpentIn]:
    """What one scope of a budget spent in each span of its window, oldest first, every span listed
    (nothing spent: 0). The spans add up to what `budget_spent` reports for that scope."""
    span = span_for(budget.window)
    since = now - budget.window
    found = {s.start: s for s in await ledger.budget_spending(name, principal, session, since, now, span)}
    first, last = math.floor(since / span), math.floor(now / span)
    if found:  # an operation another process claimed just after `now` counts, so it is drawn too
        last = max(last, round(max(found) / span))
    return [found.get(i * span, SpentIn(i * span, ZERO, 0)) for i in range(first, last + 1)]
