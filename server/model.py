"""Names shared by every layer: idempotency classes, operation states, error codes, records."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class IdempotencyClass(StrEnum):
    SAFE_RETRY = "safe-retry"
    KEY_REQUIRED = "key-required"
    KEY_AND_STATUS_CHECK = "key-and-status-check"
    COMPENSABLE = "compensable"

    @property
    def keyed(self) -> bool:
        return self is not IdempotencyClass.SAFE_RETRY


class State(StrEnum):
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


class RetryAdvice(StrEnum):
    DONE = "done"
    WAIT_AND_POLL = "wait_and_poll"
    SAFE_TO_RETRY_SAME_KEY = "safe_to_retry_same_key"
    DO_NOT_RETRY = "do_not_retry"


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A tool's answer in MCP wire shape: content blocks (dicts) and optional structured content."""

    content: list[dict[str, Any]]
    structured: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(
            {"content": self.content, "structuredContent": self.structured}, separators=(",", ":")
        )

    @classmethod
    def from_json(cls, text: str) -> ToolResult:
        data = json.loads(text)
        return cls(content=data["content"], structured=data.get("structuredContent"))

    @classmethod
    def of(cls, value: Any) -> ToolResult:
        """Wrap a plain Python value: objects become structured content, anything else `{"result": v}`."""
        if isinstance(value, ToolResult):
            return value
        structured = value if isinstance(value, dict) else {"result": value}
        text = json.dumps(value, separators=(",", ":"), default=str, ensure_ascii=False)
        return cls(content=[{"type": "text", "text": text}], structured=structured)


@dataclass(slots=True)
class Operation:
    """One row of the ledger: a logical action, unique on (principal, session, step)."""

    operation_id: str
    principal: str
    session: str
    step: str
    tool: str
    idempotency_class: IdempotencyClass
    fingerprint: str
    state: State
    attempts: int
    fence: int
    arguments: dict[str, Any]
    created_at: float
    updated_at: float
    lease_owner: str | None = None
    lease_expires_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    result: ToolResult | None = None
    error: dict[str, Any] | None = None
    reconciliation: dict[str, Any] | None = None
    downstream_ref: str | None = None
    retention: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def iso(ts: float | None) -> str | None:
    """Timestamps cross the wire as ISO 8601 UTC with milliseconds."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
