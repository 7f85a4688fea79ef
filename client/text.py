"""What a model reads when commitgate refuses a call: the server's own words, as plain text.

Frameworks turn an error result into text in their own ways; several JSON-encode the structured
error and then wrap that string in JSON again, which hides the advice (what happened, what to do
next) behind escaped quotes. The adapters pass the model this text instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def refusal_text(error: Mapping[str, Any]) -> str:
    """`[code] message`: the same text the server puts in the result's text block."""
    code = str(error.get("code") or "tool_error")
    message = str(error.get("message") or "the tool answered an error without details")
    return f"[{code}] {message}"


def error_of(value: Any) -> Mapping[str, Any] | None:
    """The `{"code", "message", ...}` block in a structured error, or in the JSON text of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, Mapping):
        inner = value.get("error", value)
        if isinstance(inner, str | Mapping) and inner is not value:
            return error_of(inner)
        if isinstance(inner, Mapping) and "code" in inner and "message" in inner:
            return inner
    return None


def readable(value: Any) -> str:
    """commitgate's refusal text when `value` holds its error (even JSON-encoded); else `value` as text."""
    error = error_of(value)
    return refusal_text(error) if error is not None else str(value)


def lost_answer_text(detail: str) -> str:
    """For a call whose answer never came back (a timeout, a dropped connection): it may have run."""
    return (
        f"No answer came back from the tool ({detail}). The call may have run: do not assume it failed. "
        "To learn its outcome, call the tool again with the same arguments and the same idempotency_key "
        "(commitgate never runs one key twice), or poll get_operation_status with that idempotency_key."
    )
