"""Unknown outcomes: the operations a person must decide, kept fresh while the page is open, and the
resolution form's target. A decision goes through core/resolutions.py, as `commitgate ops resolve`."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from commitgate.server.console.checks import CheckUnavailable, check_again, note
from commitgate.server.console.pages.base import (
    Page,
    find_visible,
    identity_of,
    ledger_of,
    now,
    policy_of,
    sole_principal,
    touch,
    visible,
)
from commitgate.server.console.pages.operations import operation_page
from commitgate.server.console.rendering import render, status_check
from commitgate.server.console.security import Denied, checked_form
from commitgate.server.core.resolutions import Finding, Resolution, ResolutionError, resolve
from commitgate.server.ledger import OperationFilter
from commitgate.server.model.facts import State

SHOWN = 200  # the newest this many; the operations page searches the rest
POLL_SECONDS = 3


async def _entries(request: Request) -> dict[str, Any]:
    ledger = ledger_of(request)
    await touch(ledger, now())
    found = await find_visible(request, OperationFilter(None, state=State.UNKNOWN, limit=SHOWN + 1))
    return {
        "entries": [(op, status_check(op)) for op in found[:SHOWN]],
        "more": len(found) > SHOWN,
        "shown": SHOWN,
        "all_principals": sole_principal(request) is None,
    }


async def unknown_page(request: Request) -> Response:
    resolved = None
    resolved_id = request.query_params.get("resolved")
    if resolved_id:  # said from the ledger, never from the address: a link cannot fake a decision
        resolved = await visible(request, resolved_id)
    return render(
        request,
        "unknown.html",
        title="Unknown outcomes",
        resolved=resolved,
        poll_seconds=POLL_SECONDS,
        **await _entries(request),
    )


async def unknown_rows(request: Request) -> Response:
    """The list alone, for the page's live updates."""
    return render(request, "unknown_rows.html", **await _entries(request))


async def resolve_route(request: Request) -> Response:
    operation_id = request.path_params["operation_id"]
    form = await checked_form(request)
    typed = {name: str(form.get(name) or "") for name in ("reason", "result")}
    try:
        finding = Finding(str(form.get("finding") or ""))
    except ValueError:
        return await operation_page(
            request, operation_id, status_code=400, problem="Choose one of the three outcomes.", typed=typed
        )
    op = await visible(request, operation_id)
    if op is None:
        raise Denied(404, f"There is no operation {operation_id} in the ledger (purged, or a typo?).")
    resolution = Resolution(finding, identity_of(request).name, typed["reason"], typed["result"] or None)
    try:
        await resolve(ledger_of(request), operation_id, resolution, now(), op.principal)
    except ResolutionError as exc:
        status = 400 if exc.field else 409
        return await operation_page(
            request, operation_id, status_code=status, problem=str(exc), problem_field=exc.field, typed=typed
        )
    return RedirectResponse(f"/unknown?resolved={operation_id}", status_code=303)


async def check_route(request: Request) -> Response:
    """*Check again*: the tool's status check, asked now; its answer shown and noted, the state kept."""
    operation_id = request.path_params["operation_id"]
    await checked_form(request)
    op = await visible(request, operation_id)
    if op is None:
        raise Denied(404, f"There is no operation {operation_id} in the ledger (purged, or a typo?).")
    try:
        checked = await check_again(op, policy_of(request), request.app.state.policy_dir, now())
        await note(ledger_of(request), op, checked, identity_of(request).name, now())
    except CheckUnavailable as exc:
        return await operation_page(request, operation_id, status_code=409, problem=str(exc))
    return await operation_page(
        request, operation_id, notice=checked.said(), typed={"result": checked.result_json()}
    )


PAGE = Page(
    label="Unknown outcomes",
    path="/unknown",
    routes=[
        Route("/unknown", unknown_page, methods=["GET"]),
        Route("/unknown/rows", unknown_rows, methods=["GET"]),
        Route("/operations/{operation_id}/resolve", resolve_route, methods=["POST"]),
        Route("/operations/{operation_id}/check", check_route, methods=["POST"]),
    ],
)
