"""What a reviewer reads about an operation awaiting approval, on the list and on its own page."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from commitgate.server.console.pages.base import ledger_of, policy_of, visible
from commitgate.server.core import approvals, budgets
from commitgate.server.core.budgets import Budget
from commitgate.server.model.facts import ApprovalState
from commitgate.server.model.notes import ApprovalRecord
from commitgate.server.model.records import Operation
from commitgate.server.policy.masking import mask_values

NOTES = ("Possible duplicate of ", "Budget ", "Over budget ")  # what the question says beyond the facts
VIA = "operator"  # the console is an operator's surface: a policy's `via = ["operator"]` covers it


@dataclass(frozen=True, slots=True)
class Waiting:
    """One operation awaiting a decision, as a reviewer sees it."""

    op: Operation
    prompt: str  # the question's first line: the policy's prompt, filled in and masked
    notes: list[str]  # what else the question says that the facts do not (a possible duplicate)
    requested_at: float
    expires_at: float | None
    waited: str
    expires_in: str
    operator_decides: bool  # False: the policy lets only the client's user decide this one
    deciders: str


def duration(seconds: float) -> str:
    """A span as people say it, to the minute: "under a minute", "12 min", "3 h 5 min", "2 d 4 h"."""
    minutes = int(max(seconds, 0.0) // 60)
    if minutes < 1:
        return "under a minute"
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


async def waiting(request: Request, op: Operation, at: float) -> Waiting:
    """What a reviewer reads about `op`: the question core/approvals.py builds, masked for a screen."""
    record = op.approval or ApprovalRecord(ApprovalState.AWAITING)
    earlier = None
    if record.duplicate_of:
        earlier = await visible(request, record.duplicate_of)
    policy = policy_of(request)
    tool = policy.tools.get(op.tool) if policy else None
    declared = policy.budget_of(op.tool) if policy else None
    budget = Budget(tool.budget, declared) if tool and tool.budget and declared else None
    figures = await budgets.standing(ledger_of(request), budget, op, at)
    text = approvals.question(op, tool, earlier, figures).text
    lines = str(mask_values(text)).splitlines()  # card numbers in free text, too
    requested_at = float(record.requested_at) if record.requested_at is not None else op.created_at
    expires_at = float(record.expires_at) if record.expires_at is not None else None
    deciders = list(record.deciders)
    return Waiting(
        op=op,
        prompt=lines[0] if lines else "",
        notes=[line for line in lines if line.startswith(NOTES)],
        requested_at=requested_at,
        expires_at=expires_at,
        waited=duration(at - requested_at),
        expires_in=duration(expires_at - at) if expires_at is not None else "",
        operator_decides=VIA in deciders,
        deciders=", ".join(deciders),
    )
