"""Waiting for approval: the calls a person must say yes to before they run, kept fresh while the
page is open, with approve / deny on each row. A decision goes through core/approvals.py's `decide`,
the one function `commitgate ops approve|deny` and the client's user go through too."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from commitgate.server.console.pages.base import (
    Page,
    find_visible,
    identity_of,
    ledger_of,
    now,
    sole_principal,
    touch,
    visible,
)
from commitgate.server.console.pages.operations import operation_page
from commitgate.server.console.pages.questions import VIA, waiting
from commitgate.server.console.rendering import render
from commitgate.server.console.security import Denied, checked_form
from commitgate.server.core import approvals
from commitgate.server.ledger import OperationFilter
from commitgate.server.model.facts import State

SHOWN = 200  # the newest this many; the operations page searches the rest
POLL_SECONDS = 3
MAX_REASON = 2000
DECISIONS = ("approve", "deny")


async def _entries(request: Request) -> dict[str, Any]:
    ledger = ledger_of(request)
    at = now()
    await touch(ledger, at)  # a wait that ran out is expired here, as the sweep would, not listed
    found = await find_visible(request, OperationFilter(None, state=State.AWAITING_APPROVAL, limit=SHOWN + 1))
    return {
        "entries": [await waiting(request, op, at) for op in found[:SHOWN]],
        "more": len(found) > SHOWN,
        "shown": SHOWN,
        "all_principals": sole_principal(request) is None,
    }


async def approvals_page(request: Request, *, status_code: int = 200, problem: str | None = None) -> Response:
    decided = None
    decided_id = request.query_params.get("decided")
    if decided_id:  # said from the ledger, never from the address: a link cannot fake a decision
        decided = await visible(request, decided_id)
    return render(
        request,
        "approvals.html",
        status_code,
        title="Waiting for approval",
        decided=decided,
        problem=problem,
        poll_seconds=POLL_SECONDS,
        **await _entries(request),
    )


async def approvals_route(request: Request) -> Response:
    return await approvals_page(request)


async def approvals_rows(request: Request) -> Response:
    """The list alone, for the page's live updates."""
    return render(request, "approvals_rows.html", **await _entries(request))


async def _refused(
    request: Request, operation_id: str, status: int, problem: str, reason: str, back: str
) -> Response:
    """Nothing recorded: the page the form came from says why. A form to fix (a reason missing) is the
    operation's own page, with what was typed; a decision no longer possible, the list."""
    if back == "list" and status != 400:
        return await approvals_page(request, status_code=status, problem=problem)
    return await operation_page(
        request,
        operation_id,
        status_code=status,
        problem=problem,
        problem_field="approval-reason",
        typed={"approval_reason": reason},
    )


async def decide_route(request: Request) -> Response:
    operation_id = request.path_params["operation_id"]
    form = await checked_form(request)
    decision = str(form.get("decision") or "")
    reason = str(form.get("reason") or "").strip()
    back = "operation" if form.get("from") == "operation" else "list"
    ledger = ledger_of(request)
    op = await visible(request, operation_id)
    if op is None:
        raise Denied(404, f"There is no operation {operation_id} in the ledger (purged, or a typo?).")
    problem = None
    if decision not in DECISIONS:
        problem = "Choose Approve or Deny."
    elif decision == "deny" and not reason:
        problem = "A denial needs a reason: the agent is told it. Write why, then press Deny."
    elif len(reason) > MAX_REASON:
        problem = f"The reason is too long: at most {MAX_REASON} characters."
    if problem is not None:
        return await _refused(request, operation_id, 400, problem, reason, back)
    try:
        await approvals.decide(
            ledger,
            operation_id,
            "approve" if decision == "approve" else "deny",
            by=identity_of(request).name,
            via=VIA,
            reason=reason or None,
            now=now(),
            principal=op.principal,
        )
    except approvals.ApprovalRefused as exc:  # decided already, expired, or not ours to decide
        said = str(exc)
        return await _refused(
            request, operation_id, 409, said if said.endswith(".") else said + ".", reason, back
        )
    return RedirectResponse(f"/approvals?decided={operation_id}", status_code=303)


PAGE = Page(
    label="Waiting for approval",
    path="/approvals",
    routes=[
        Route("/approvals", approvals_route, methods=["GET"]),
        Route("/approvals/rows", approvals_rows, methods=["GET"]),
        Route("/operations/{operation_id}/decide", decide_route, methods=["POST"]),
    ],
)
