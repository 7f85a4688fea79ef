"""Recent operations with search (tool, state, session, key, principal), and one operation's page."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from commitgate.server.console.pages.base import (
    Page,
    find_visible,
    ledger_of,
    now,
    sole_principal,
    touch,
    visible,
)
from commitgate.server.console.pages.questions import waiting
from commitgate.server.console.rendering import (
    dated,
    history_rows,
    render,
    shown_json,
    shown_result,
    status_check,
)
from commitgate.server.console.security import Denied
from commitgate.server.core import approvals, expiry
from commitgate.server.core.resolutions import Finding, Resolution, note_for
from commitgate.server.ledger import OperationFilter
from commitgate.server.model.facts import IdempotencyClass, State

LIMITS = (50, 200, 1000)
SEARCH_FIELDS = ("tool", "state", "session", "key", "principal")


def _search(request: Request) -> tuple[dict[str, str], OperationFilter]:
    """The search form's values as typed, and the filter they make (a bad value is a clear 400)."""
    typed = {name: request.query_params.get(name, "").strip() for name in SEARCH_FIELDS}
    if sole_principal(request) is not None:
        typed["principal"] = ""  # a token that sees one principal has nothing to choose
    state = None
    if typed["state"]:
        try:
            state = State(typed["state"].upper())
        except ValueError:
            raise Denied(400, f"There is no state {typed['state']!r}; pick one from the list.") from None
    limit_text = request.query_params.get("limit", str(LIMITS[0]))
    limit = int(limit_text) if limit_text.isdigit() and int(limit_text) in LIMITS else LIMITS[0]
    typed["limit"] = str(limit)
    where = OperationFilter(
        principal=typed["principal"] or None,
        session=typed["session"] or None,
        state=state,
        tool=typed["tool"] or None,
        step=typed["key"] or None,
        limit=limit,
    )
    return typed, where


async def operations_page(request: Request) -> Response:
    typed, where = _search(request)
    ledger = ledger_of(request)
    await touch(ledger, now())
    found = await find_visible(request, where)
    return render(
        request,
        "operations.html",
        title="Operations",
        search=typed,
        states=[s.value for s in State],
        limits=LIMITS,
        operations=found,
        searched=any(typed[name] for name in SEARCH_FIELDS),
        all_principals=sole_principal(request) is None,
    )


async def operation_page(
    request: Request,
    operation_id: str,
    *,
    status_code: int = 200,
    problem: str | None = None,
    problem_field: str | None = None,
    typed: dict[str, str] | None = None,
    notice: str | None = None,
) -> Response:
    """One operation: its facts, arguments, outcome, status check and full audit history; a form to
    resolve it while it is UNKNOWN (with *Check again* when its tool has a status check)."""
    ledger = ledger_of(request)
    op = await visible(request, operation_id)
    if op is None:
        raise Denied(404, f"There is no operation {operation_id} in the ledger (purged, or a typo?).")
    at = now()
    op = await expiry.touch(ledger, op, at)  # a lapsed lease shows as UNKNOWN, a wait that ran out as expired
    history = await ledger.history(op.operation_id)
    view: dict[str, Any] = {
        "op": op,
        "arguments": shown_json(op.arguments),
        "result": shown_result(op.result),
        "error": shown_json(op.error.stored()) if op.error is not None else None,
        "reconciliation": (
            shown_json(dated(op.reconciliation.stored())) if op.reconciliation is not None else None
        ),
        "status_check": status_check(op),
        # what `ops resolve` warns about when no result is given (a compensable tool's compensation)
        "result_hint": note_for(op, Resolution(Finding.SUCCEEDED, "")),
        "history": history_rows(history, op.principal),
        "approval": approvals.status(op),
        "waiting": await waiting(request, op, at) if op.state is State.AWAITING_APPROVAL else None,
        "problem": problem,
        "notice": notice,
        "can_check": op.idempotency_class is IdempotencyClass.KEY_AND_STATUS_CHECK,
        "problem_field": problem_field,
        "typed": {"reason": "", "result": "", "approval_reason": "", **(typed or {})},
    }
    return render(request, "operation.html", status_code, title=f"Operation {op.operation_id}", **view)


async def operation_route(request: Request) -> Response:
    return await operation_page(request, request.path_params["operation_id"])


PAGE = Page(
    label="Operations",
    path="/operations",
    routes=[
        Route("/operations", operations_page, methods=["GET"]),
        Route("/operations/{operation_id}", operation_route, methods=["GET"]),
    ],
)
