"""What the commit boundary tells its observers (metrics, logs, traces), and the observer's shape."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

from commitgate.server.model.facts import IdempotencyClass


class Event(StrEnum):
    """A notable moment of a guarded call. Fields that come with it are named in the comment."""

    ATTEMPT = "attempt"  # one execution ended: outcome
    RETRY = "retry"  # another attempt follows a failed one
    REPLAY = "replay"  # answered from a recorded outcome
    CONFLICT = "conflict"  # a key reused with another tool or other arguments
    RECONCILIATION = "reconciliation"  # a status check answered: verdict
    LEASE_EXPIRED = "lease_expired"  # a RUNNING operation whose owner stopped became UNKNOWN
    COMPLETED = "completed"  # an outcome was recorded: state, seconds
    LEDGER_UNAVAILABLE = "ledger_unavailable"  # a keyed call refused: nothing executed
    RESULT_TOO_LARGE = "result_too_large"  # a result over the ledger's size limit
    POSSIBLE_DUPLICATE = "possible_duplicate"  # a fresh-key repeat of a recent operation, refused
    DUPLICATE_ALLOWED = "duplicate_allowed"  # a fresh-key repeat run anyway (allow, or confirmed)
    APPROVAL_REQUESTED = "approval_requested"  # a call recorded AWAITING_APPROVAL: operation_id
    APPROVAL_EXPIRED = "approval_expired"  # nobody decided in time: FAILED_FINAL, operation_id
    BUDGET_SPENT = "budget_spent"  # a call claimed an amount of a budget: budget, scope, amount
    BUDGET_EXCEEDED = (
        "budget_exceeded"  # a call past its budget's limit, refused or sent to a person: budget, scope
    )


class Observer(Protocol):
    """Called on every event; must be quick and must never raise (instrumentation cannot break a call)."""

    def __call__(self, event: Event, tool: str, cls: IdempotencyClass, **fields: Any) -> None: ...
