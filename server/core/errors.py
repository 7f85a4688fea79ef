"""One exception type for every way a guarded call can end without a result.

Each carries its code (docs/contract.md#error-codes) and a message that tells the model what to do next.
"""

from __future__ import annotations

from typing import Any

from commitgate.server.model.facts import ErrorCode, IdempotencyClass
from commitgate.server.model.notes import ErrorRecord
from commitgate.server.model.records import Operation


class GateError(Exception):
    def __init__(
        self,
        code: ErrorCode,
        message: str,
        operation: Operation | None = None,
        *,
        details: dict[str, Any] | None = None,  # more fields of `error`, e.g. `duplicate_of`
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.operation = operation
        self.details = details or {}
        self.replayed = False  # answered from a recorded failure, not from this call's execution


def _reason(op: Operation) -> str:
    if op.error is not None and op.error.message:
        return f" ({op.error.message})"
    return ""


def invalid_arguments(detail: str) -> GateError:
    return GateError(
        ErrorCode.INVALID_ARGUMENTS,
        f"Invalid arguments: {detail}. Nothing was executed or recorded; fix the arguments and call again.",
    )


def key_required(tool: str) -> GateError:
    return GateError(
        ErrorCode.IDEMPOTENCY_KEY_REQUIRED,
        f"{tool} changes something in the world and needs an `idempotency_key`: choose a new unique value "
        "for this action (e.g. 'refund-order-1234-1') and reuse exactly that value if you retry it. "
        "Nothing was executed.",
    )


def invalid_key(detail: str) -> GateError:
    return GateError(
        ErrorCode.INVALID_IDEMPOTENCY_KEY,
        f"Invalid idempotency_key: {detail}. Use 1-255 characters of letters, digits and . _ : @ / + = -. "
        "Nothing was executed.",
    )


def key_reused(op: Operation, tool: str) -> GateError:
    what = f"the tool {op.tool}" if op.tool != tool else "other arguments"
    return GateError(
        ErrorCode.IDEMPOTENCY_KEY_REUSED,
        f"The idempotency_key {op.step!r} was already used with {what} in this session. Nothing was executed. "
        "If this is a new action, call again with a new idempotency_key; if it is a retry, resend the "
        "original arguments unchanged.",
        op,
    )


def in_progress(op: Operation) -> GateError:
    return GateError(
        ErrorCode.OPERATION_IN_PROGRESS,
        f"This operation ({op.operation_id}) is still running. Do not call the tool again with a new key; poll "
        f"get_operation_status with idempotency_key {op.step!r} until it finishes.",
        op,
    )


def outcome_unknown(op: Operation, *, retry_is_safe: bool = False) -> GateError:
    if retry_is_safe:
        advice = (
            "Its downstream deduplicates on the idempotency_key, so calling again later with the same "
            f"idempotency_key {op.step!r} is safe; never use a new key for it."
        )
    elif op.idempotency_class is IdempotencyClass.COMPENSABLE:
        advice = (
            "Do not retry it. Either undo the session with compensate_session, or ask a person to check "
            "and resolve it."
        )
    else:
        advice = (
            "It was not executed again, and must not be retried blindly: poll get_operation_status later, "
            "or ask a person to check the system of record and resolve it."
        )
    return GateError(
        ErrorCode.OPERATION_OUTCOME_UNKNOWN,
        f"The outcome of this operation is unknown: it may or may not have taken effect{_reason(op)}. {advice}",
        op,
    )


def failed(message: str, op: Operation | None) -> GateError:
    return GateError(
        ErrorCode.OPERATION_FAILED,
        f"The operation failed and was not applied: {message}. Retrying with the same key returns this same "
        "failure; change the request (and use a new idempotency_key) only if the failure says how.",
        op,
    )


def retries_exhausted(message: str, op: Operation | None) -> GateError:
    again = (
        "You may call again later with the same idempotency_key."
        if op is not None
        else "You may call again later."
    )
    return GateError(
        ErrorCode.RETRIES_EXHAUSTED,
        f"The tool kept failing with transient errors and was certainly not applied ({message}). {again}",
        op,
    )


def ledger_unavailable() -> GateError:
    """Why is the operator's business (it is logged): the client never sees where the ledger lives."""
    return GateError(
        ErrorCode.LEDGER_UNAVAILABLE,
        "The operation ledger could not record this call, so it was NOT executed. Try again shortly with the "
        "same idempotency_key.",
    )


def approval_pending(op: Operation) -> GateError:
    over = op.approval.over_budget if op.approval is not None else None
    why = (
        f" It would take budget {over.name!r} past its limit, so a person decides whether to spend more."
        if over is not None
        else ""
    )
    return GateError(
        ErrorCode.APPROVAL_PENDING,
        f"This action needs a person's approval before it runs; it was recorded (operation {op.operation_id}) "
        f"and nothing was executed yet.{why} Tell the user it is waiting for approval. Do not call again with a new "
        f"key: poll get_operation_status with idempotency_key {op.step!r}, and once it is approved call again "
        "with the same idempotency_key and the same arguments to run it (exactly once).",
        op,
    )


def approval_denied(op: Operation) -> GateError:
    return GateError(
        ErrorCode.APPROVAL_DENIED,
        f"A person denied this action{_reason(op)}; it was not executed and will not be. Do not retry it, with "
        "this key or another; tell the user, and ask how to proceed if the reason says so.",
        op,
    )


def approval_expired(op: Operation) -> GateError:
    return GateError(
        ErrorCode.APPROVAL_EXPIRED,
        f"Nobody approved this action in time{_reason(op)}; it was not executed. Do not retry it with this key; "
        "if it is still wanted, ask the user, then call again with a new idempotency_key to request approval anew.",
        op,
    )


def budget_exceeded(
    budget: dict[str, Any], figures: dict[str, str], scope: str, *, recorded: bool = False
) -> GateError:
    """`budget` is `error.budget`: {name, limit, spent, window[, unit]}; `figures` the amount, limit,
    spent and left as people read them (with the unit); `scope` says whose spending it is.
    `recorded`: an approved operation refused when taken to run, recorded FAILED_FINAL."""
    what = (
        "Budget exceeded: nothing was executed. This call was approved, then refused when it was about to "
        "run, and is recorded as failed: calling again with this key gives this same answer."
        if recorded
        else "Budget exceeded: nothing was executed or recorded."
    )
    return GateError(
        ErrorCode.BUDGET_EXCEEDED,
        f"{what} This call would spend {figures['amount']} from budget {budget['name']!r}, which allows "
        f"{figures['limit']} {scope} within any {budget['window']}; {figures['spent']} is already spent in "
        f"that window, so {figures['left']} is left. Calling again is refused the same way until earlier spending leaves the window or is undone. Do not split the action into smaller "
        "calls to get around the limit: tell the user the budget is used up, and ask a person to raise the "
        "limit if the action is needed.",
        details={"budget": budget},
    )


def budget_exceeded_recorded(op: Operation) -> GateError:
    """The replay of an operation refused at its take: the message and budget it was recorded with."""
    error = op.error or ErrorRecord()
    return GateError(
        ErrorCode.BUDGET_EXCEEDED,
        str(error.message or "Budget exceeded: nothing was executed."),
        op,
        details={"budget": dict(error.budget)} if error.budget is not None else None,
    )
