"""Typed errors of `Gate.call`: each carries the server's code, its message and the operation view.

The server decides what a failure means (its codes and `retry_advice`); these classes only give
each decision a name a program can catch.
"""

from __future__ import annotations

from typing import Any


class CommitgateError(Exception):
    """A guarded call that ended without a result; `operation` is what the server showed of it."""

    def __init__(
        self, code: str, message: str, operation: dict[str, Any] | None = None, **details: Any
    ) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.operation = operation
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        # Durable engines record a failed step's exception by pickling it (DBOS does) and raise it
        # again on replay: it must come back whole, not fail for want of `message`.
        return (type(self), (self.code, self.message, self.operation), self.__dict__)


class OutcomeUnknown(CommitgateError):
    """It may or may not have taken effect; it was not run again. Ask a person, or poll later."""


class KeyReused(CommitgateError):
    """This step was already used with another tool or other arguments; nothing was executed."""


class PossibleDuplicate(CommitgateError):
    """A recent operation did exactly this under another key; nothing was executed.

    `duplicate_of` is that operation's status view, its result included.
    """

    @property
    def duplicate_of(self) -> dict[str, Any]:
        return dict(self.details.get("duplicate_of") or {})


class ApprovalDenied(CommitgateError):
    """A person denied the action, or did not decide in time (`code` says which)."""


class BudgetExceeded(CommitgateError):
    """The call would take a budget past its limit; `budget` says which and how much is spent."""

    @property
    def budget(self) -> dict[str, Any]:
        return dict(self.details.get("budget") or {})


class OperationFailed(CommitgateError):
    """The tool failed for good (or kept failing transiently); it was not applied."""


class StillRunning(CommitgateError):
    """The operation did not finish within the gate's wait; it continues on the server. Call again later."""


ERRORS: dict[str, type[CommitgateError]] = {
    "operation_outcome_unknown": OutcomeUnknown,
    "idempotency_key_reused": KeyReused,
    "possible_duplicate": PossibleDuplicate,
    "approval_denied": ApprovalDenied,
    "approval_expired": ApprovalDenied,
    "budget_exceeded": BudgetExceeded,
    "operation_failed": OperationFailed,
    "retries_exhausted": OperationFailed,
}


def error_for(error: dict[str, Any]) -> CommitgateError:
    """The typed error for a `structuredContent.error` block."""
    code = str(error.get("code", "unknown"))
    details = {k: v for k, v in error.items() if k not in ("code", "message", "operation")}
    kind = ERRORS.get(code, CommitgateError)
    return kind(code, str(error.get("message", "")), error.get("operation"), **details)
