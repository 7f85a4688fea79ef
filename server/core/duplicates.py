"""Duplicate detection: the same action re-issued under a fresh key.

A model that lost its context re-issues a call with a new key; a restarted workflow does the
same. The key cannot catch that; the arguments can. For keyed tools with detection on (the
default), a call with a key not seen before whose fingerprint matches a recent operation in
scope answers `possible_duplicate` and executes nothing. The ledger decides it inside the claim
(`DuplicateCheck`), so concurrent fresh-key copies cannot all get through.

Here: the policy turned into the claim's check, the optional `confirm_duplicate` argument, and
the answer the model reads. The contract: docs/contract.md#duplicates.
"""

from __future__ import annotations

import json
from typing import Any

from commitgate.server.core import errors
from commitgate.server.core.errors import GateError
from commitgate.server.ledger.base import DuplicateCheck
from commitgate.server.model.facts import ErrorCode, State
from commitgate.server.model.records import Operation, iso
from commitgate.server.policy.models import ToolPolicy

CONFIRM_ARGUMENT = "confirm_duplicate"

CONFIRM_PROPERTY: dict[str, Any] = {
    "type": "boolean",
    "default": False,
    "description": (
        "Leave this out. Set it to true only when you deliberately want to do the same action a second "
        "time (for example the user asked for two identical orders) after this tool answered "
        "possible_duplicate; then also pass a new idempotency_key. Never set it to retry a call whose "
        "answer you did not see: that would do the action twice."
    ),
}

_RESULT_CHARS = 600  # enough for the model to recognise what was done; the full result is in duplicate_of


def detects(policy: ToolPolicy) -> bool:
    return policy.idempotency_class.keyed and policy.duplicates is not None


def check_for(policy: ToolPolicy, confirmed: bool) -> DuplicateCheck | None:
    """What the ledger's claim looks for, or None when the tool does not detect duplicates."""
    options = policy.duplicates
    if options is None or not policy.idempotency_class.keyed:
        return None
    return DuplicateCheck(
        window_seconds=options.window,
        any_session=options.scope == "principal",
        reject=options.action in ("reject", "approval"),  # approval: refused here, then recorded to wait
        # With action "approval" a person decides, not the model: confirm_duplicate does not skip it.
        confirmed=confirmed and options.action != "approval",
    )


def asks_approval(policy: ToolPolicy) -> bool:
    return policy.duplicates is not None and policy.duplicates.action == "approval"


def add_confirm_property(schema: dict[str, Any], policy: ToolPolicy) -> dict[str, Any]:
    """The input schema of a tool with detection on lists the optional `confirm_duplicate`."""
    if detects(policy):
        schema.setdefault("properties", {})[CONFIRM_ARGUMENT] = CONFIRM_PROPERTY
    return schema


def take_confirm(arguments: dict[str, Any], policy: ToolPolicy) -> bool:
    """Remove `confirm_duplicate` from the arguments (it never reaches the tool or the fingerprint)."""
    if not detects(policy) or CONFIRM_ARGUMENT not in arguments:
        return False
    value = arguments.pop(CONFIRM_ARGUMENT)
    if not isinstance(value, bool):
        raise errors.invalid_arguments(
            f"{CONFIRM_ARGUMENT} must be true or false (got {json.dumps(value, default=str)[:40]}); leave it "
            "out unless you deliberately repeat an action"
        )
    return value


def possible_duplicate(op: Operation, view: dict[str, Any], tool: str, now: float) -> GateError:
    """The answer to a fresh-key call that repeats `op`: what was done, when, with what result, what to do."""
    message = (
        f"Possible duplicate: nothing was executed now. {tool} was already called with exactly these arguments "
        f"{_ago(op.created_at, now)} ({iso(op.created_at)}) in session {op.session!r}, under idempotency_key {op.step!r} "
        f"(operation {op.operation_id}). {_outcome(op)} "
        "If you are repeating that call because you did not see its answer, or lost track of it, do not call "
        f"again: use the outcome above, or poll get_operation_status with idempotency_key {op.step!r} and "
        f"session {op.session!r}. Only if you deliberately want this same action a second time, call again "
        "with a new idempotency_key and confirm_duplicate: true."
    )
    return GateError(ErrorCode.POSSIBLE_DUPLICATE, message, None, details={"duplicate_of": view})


def _outcome(op: Operation) -> str:
    if op.state is State.SUCCEEDED:
        return f"It succeeded with this result: {_result_text(op)}."
    if op.state in (State.RUNNING, State.PENDING):
        return "It is still running; its result is not known yet."
    if op.state is State.AWAITING_APPROVAL:
        return "It is waiting for a person's approval and has not run yet."
    if op.state is State.UNKNOWN:
        return "Its outcome is unknown: it may have taken effect, so repeating it could do it twice."
    return f"It is {op.state.value.lower().replace('_', ' ')}."


def _result_text(op: Operation) -> str:
    result = op.result
    if result is None:
        return "(no result recorded)"
    texts = [str(block.get("text", "")) for block in result.content if block.get("type") == "text"]
    text = " ".join(t for t in texts if t) or json.dumps(
        result.structured, separators=(",", ":"), default=str
    )
    return text if len(text) <= _RESULT_CHARS else text[:_RESULT_CHARS] + "..."


def _ago(then: float, now: float) -> str:
    seconds = max(0, round(now - then))
    if seconds < 2:
        return "just now"
    if seconds < 120:
        return f"{seconds} seconds ago"
    if seconds < 7200:
        return f"{seconds // 60} minutes ago"
    return f"{seconds // 3600} hours ago"
