"""Names shared by every layer: idempotency classes, operation states, error codes, records."""

from __future__ import annotations

import re
from enum import StrEnum


class IdempotencyClass(StrEnum):
    SAFE_RETRY = "safe-retry"
    KEY_REQUIRED = "key-required"
    KEY_AND_STATUS_CHECK = "key-and-status-check"
    COMPENSABLE = "compensable"

    @property
    def keyed(self) -> bool:
        return self is not IdempotencyClass.SAFE_RETRY


class State(StrEnum):
    AWAITING_APPROVAL = "AWAITING_APPROVAL"  # recorded, waiting for a person's decision; no attempt yet
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED_FINAL = "FAILED_FINAL"
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    UNKNOWN = "UNKNOWN"
    COMPENSATED = "COMPENSATED"

    @property
    def terminal(self) -> bool:
        """Completed states: the record's retention clock runs from here."""
        return self in _COMPLETED


_COMPLETED = frozenset({State.SUCCEEDED, State.FAILED_FINAL, State.FAILED_RETRYABLE, State.COMPENSATED})


class ErrorCode(StrEnum):
    INVALID_ARGUMENTS = "invalid_arguments"
    IDEMPOTENCY_KEY_REQUIRED = "idempotency_key_required"
    INVALID_IDEMPOTENCY_KEY = "invalid_idempotency_key"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    OPERATION_IN_PROGRESS = "operation_in_progress"
    OPERATION_OUTCOME_UNKNOWN = "operation_outcome_unknown"
    OPERATION_FAILED = "operation_failed"
    RETRIES_EXHAUSTED = "retries_exhausted"
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    POSSIBLE_DUPLICATE = "possible_duplicate"
    APPROVAL_PENDING = "approval_pending"
    APPROVAL_DENIED = "approval_denied"
    APPROVAL_EXPIRED = "approval_expired"
    BUDGET_EXCEEDED = "budget_exceeded"


class ApprovalState(StrEnum):
    """Where a person's decision on an operation stands (the status view's `approval.state`)."""

    AWAITING = "awaiting"
    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"


class RetryAdvice(StrEnum):
    DONE = "done"
    WAIT_AND_POLL = "wait_and_poll"
    SAFE_TO_RETRY_SAME_KEY = "safe_to_retry_same_key"
    DO_NOT_RETRY = "do_not_retry"


# The `_meta` names a client or orchestrator may send, and the one every guarded result carries.
SESSION_META = "commitgate/session"
STEP_META = "commitgate/step"
OPERATION_META = "commitgate/operation"

# An idempotency key: 1 to KEY_MAX_LENGTH of these characters, matched against the whole string.
KEY_CHARACTERS = r"[A-Za-z0-9._:@/+=\-]"
KEY_MAX_LENGTH = 255
KEY_PATTERN = re.compile(rf"{KEY_CHARACTERS}{{1,{KEY_MAX_LENGTH}}}")

# `{arguments.X}` / `{result.X}` in a compensation's arguments: a field of the forward call.
REFERENCE = re.compile(r"\{(arguments|result)((?:\.[A-Za-z0-9_\-]+)+)\}")
