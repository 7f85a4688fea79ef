"""What a guarded call is made of, before the ledger sees it: the tool, the settings it keeps, the
request, the answer.

The fingerprint (docs/contract.md#fingerprint), the key and session checks, and the error an
operation's recorded state answers with live here, beside the records they describe.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from commitgate.server.core import duplicates, errors
from commitgate.server.core.budgets import Budget
from commitgate.server.core.errors import GateError
from commitgate.server.ledger.base import DuplicateCheck
from commitgate.server.model.facts import KEY_MAX_LENGTH, KEY_PATTERN, ErrorCode, IdempotencyClass, State
from commitgate.server.model.records import Operation, ToolResult
from commitgate.server.policy.models import ServerPolicy, ToolPolicy
from commitgate.tools.base import ToolSource


@dataclass(frozen=True, slots=True)
class GuardedTool:
    name: str
    policy: ToolPolicy
    source: ToolSource
    budget: Budget | None = None  # the declared budget its calls spend from
    # Read several times by every call, so kept as plain attributes: a tool's policy never changes
    # (a reload builds new tools).
    idempotency_class: IdempotencyClass = field(init=False, repr=False, compare=False)
    keyed: bool = field(init=False, repr=False, compare=False)
    # What its claims look for under other keys, indexed by the call's confirm_duplicate.
    duplicate_checks: tuple[DuplicateCheck | None, DuplicateCheck | None] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "idempotency_class", self.policy.idempotency_class)
        object.__setattr__(self, "keyed", self.policy.idempotency_class.keyed)
        checks = (duplicates.check_for(self.policy, False), duplicates.check_for(self.policy, True))
        object.__setattr__(self, "duplicate_checks", checks)


@dataclass(frozen=True, slots=True)
class RunSettings:
    """The `[server]` settings a call keeps from its claim to the record of its outcome: those of the
    policy it was claimed under, whatever a reload changes meanwhile."""

    lease: float
    respond_within: float
    in_progress_wait: float
    retention: float
    max_result_bytes: int

    @classmethod
    def of(cls, server: ServerPolicy) -> RunSettings:
        return cls(
            server.lease,
            server.respond_within,
            server.in_progress_wait,
            server.retention,
            server.limits.max_result_bytes,
        )


@dataclass(frozen=True, slots=True)
class CallRequest:
    tool: GuardedTool
    arguments: dict[str, Any]  # validated, normalised, without the key
    key: str | None
    session: str
    principal: str
    arguments_json: str | None = None  # canonical JSON of `arguments`, when the caller encoded it already
    confirm_duplicate: bool = False  # the caller means a second action like a recent one
    settings: RunSettings | None = None  # its policy's; None: the boundary's current ones, when it begins


@dataclass(frozen=True, slots=True)
class Answer:
    result: ToolResult | None
    operation: Operation | None
    replayed: bool
    error: GateError | None = None

    @classmethod
    def refused(cls, error: GateError) -> Answer:
        """The answer of a call that ended in a raised error: the one way errors become answers."""
        return cls(None, error.operation, error.replayed, error)


def fingerprint(tool: str, arguments_json: str) -> str:
    """SHA-256 of canonical JSON {"arguments": ..., "tool": ...}: docs/contract.md#fingerprint."""
    document = '{"arguments":' + arguments_json + _tool_tail(tool)
    return hashlib.sha256(document.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=1024)
def _tool_tail(tool: str) -> str:
    """The fingerprint's text after the arguments: the same for every call of a tool, encoded once
    (`json.dumps` with an option builds an encoder on every call)."""
    return ',"tool":' + json.dumps(tool, ensure_ascii=False) + "}"


def check_key(key: object, tool: GuardedTool) -> str | None:
    if not tool.keyed:
        return None
    if key is None or key == "":
        raise errors.key_required(tool.name)
    if not isinstance(key, str):
        raise errors.invalid_key("it must be a string")
    if len(key) > KEY_MAX_LENGTH:
        raise errors.invalid_key(f"it is {len(key)} characters long; at most {KEY_MAX_LENGTH} are allowed")
    if not KEY_PATTERN.fullmatch(key):
        raise errors.invalid_key("it contains characters outside the allowed set")
    return key


def printable(text: str) -> bool:
    """No control characters (NUL, newlines, terminal escapes...): what a session or key may hold."""
    return text.isprintable()


def check_session(session: object, where: str) -> str:
    """A session names a workflow run: 1-255 printable characters, so it is safe to store and to show."""
    if not isinstance(session, str) or not 1 <= len(session) <= 255:
        raise errors.invalid_arguments(f"{where} must be a string of 1-255 characters")
    if not printable(session):
        raise errors.invalid_arguments(
            f"{where} must hold printable characters only (no control characters, newlines or NUL)"
        )
    return session


def error_for_state(op: Operation, forwards_key: bool = False) -> GateError:
    code = op.error.code if op.error is not None else None
    if op.state is State.FAILED_FINAL and code == ErrorCode.APPROVAL_DENIED:
        return errors.approval_denied(op)
    if op.state is State.FAILED_FINAL and code == ErrorCode.APPROVAL_EXPIRED:
        return errors.approval_expired(op)
    if op.state is State.FAILED_FINAL and code == ErrorCode.BUDGET_EXCEEDED:
        return errors.budget_exceeded_recorded(op)
    if op.state is State.AWAITING_APPROVAL:
        return errors.approval_pending(op)
    if op.state is State.FAILED_FINAL:
        return errors.failed(_message(op), op)
    if op.state is State.FAILED_RETRYABLE:
        return errors.retries_exhausted(_message(op), op)
    if op.state is State.UNKNOWN:
        return errors.outcome_unknown(op, retry_is_safe=forwards_key)
    return errors.in_progress(op)


def _message(op: Operation) -> str:
    return str((op.error.message if op.error is not None else None) or "no reason recorded")
