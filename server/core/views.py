"""How operations look from outside: the `_meta` block of a result, and the status record."""

from __future__ import annotations

import time
from typing import Any

from commitgate.server.core.approvals import status as approval_status
from commitgate.server.core.classes import retry_advice
from commitgate.server.model.facts import State
from commitgate.server.model.records import Operation, iso


def operation_meta(op: Operation, replayed: bool) -> dict[str, Any]:
    """`_meta["commitgate/operation"]` on every guarded result (docs/contract.md#the-operation-block)."""
    return {
        "operation_id": op.operation_id,
        "session": op.session,
        "idempotency_key": op.step,
        "state": op.state.value,
        "replayed": replayed,
        "attempts": op.attempts,
        "created_at": iso(op.created_at),
        "completed_at": iso(op.completed_at),
    }


def status_view(op: Operation, forwards_key: bool, now: float | None = None) -> dict[str, Any]:
    """The `operation` of get_operation_status and list_operations."""
    now = time.time() if now is None else now
    lease_live = op.lease_expires_at is not None and op.lease_expires_at > now
    view: dict[str, Any] = {
        "operation_id": op.operation_id,
        "tool": op.tool,
        "idempotency_class": op.idempotency_class.value,
        "session": op.session,
        "idempotency_key": op.step,
        "state": op.state.value,
        "attempts": op.attempts,
        "created_at": iso(op.created_at),
        "updated_at": iso(op.updated_at),
        "expires_at": iso(op.expires_at),
    }
    if op.state is State.RUNNING:
        view["lease_expires_at"] = iso(op.lease_expires_at)
    if op.result is not None:
        view["result"] = {"content": op.result.content, "structuredContent": op.result.structured}
    if op.error is not None:
        view["error"] = op.error.stored()
    if op.reconciliation is not None:
        reconciliation = op.reconciliation.stored()
        if isinstance(op.reconciliation.at, int | float):
            reconciliation["at"] = iso(op.reconciliation.at)
        view["reconciliation"] = reconciliation
    if op.approval is not None:
        view["approval"] = approval_status(op)
    view["retry_advice"] = retry_advice(op.idempotency_class, op.state, forwards_key, lease_live).value
    return view
