"""The records every layer passes around: a tool's answer and one operation of the ledger."""

from __future__ import annotations

import functools
import json
import math
import operator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ApprovalRecord, ErrorRecord, ReconciliationNote

# Encoders made once: `json.dumps` with any option builds a new JSONEncoder on every call, which
# cost a guarded call more than encoding its small result. Same options, same text.
_encode_result = json.JSONEncoder(separators=(",", ":")).encode
_encode_value = json.JSONEncoder(separators=(",", ":"), default=str, ensure_ascii=False).encode


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A tool's answer in MCP wire shape: content blocks (dicts) and optional structured content."""

    content: list[dict[str, Any]]
    structured: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None  # the tool's own result `_meta` (an upstream's, kept as sent)
    # The encoded form, made once: the size limit, the ledger and the replay cache all read it.
    _json: str | None = field(default=None, init=False, repr=False, compare=False)

    def to_json(self) -> str:
        if self._json is None:
            document: dict[str, Any] = {"content": self.content, "structuredContent": self.structured}
            if self.meta:
                document["_meta"] = self.meta
            encoded = _encode_result(document)
            object.__setattr__(self, "_json", encoded)  # a cache, not a change: the value stays equal
            return encoded
        return self._json

    @classmethod
    def from_json(cls, text: str) -> ToolResult:
        data = json.loads(text)
        result = cls(
            content=data["content"], structured=data.get("structuredContent"), meta=data.get("_meta")
        )
        object.__setattr__(result, "_json", text)  # the stored text is this result's encoding
        return result

    @classmethod
    def of(cls, value: Any) -> ToolResult:
        """Wrap a plain Python value: objects become structured content, anything else `{"result": v}`."""
        if isinstance(value, ToolResult):
            return value
        structured = value if isinstance(value, dict) else {"result": value}
        text = _encode_value(value)
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
    error: ErrorRecord | None = None
    reconciliation: ReconciliationNote | None = None
    retention: float = 0.0
    approval: ApprovalRecord | None = None  # None when no person was asked
    # `arguments` as the ledger stores them (JSON), when at hand: a size is measured on it, not re-encoded.
    arguments_json: str | None = field(default=None, repr=False, compare=False)

    def copy(self) -> Operation:
        """A shallow copy: what `dataclasses.replace(op)` makes, without its keyword call per field
        (a tenth of its time; every outcome makes one). Every field, read by one C call and passed
        in order: half the time of a setattr per field."""
        return Operation(*_FIELDS(self))


_FIELDS = operator.attrgetter(*Operation.__slots__)  # every field of an Operation, in __init__'s order


@functools.lru_cache(maxsize=4096)
def iso(ts: float | None) -> str | None:
    """Timestamps cross the wire as ISO 8601 UTC with milliseconds.

    Cached: a replay shows the same few timestamps of its operation every time, and formatting
    one costs more than the rest of the operation block (a server answering replays spent 4 % of its time here).
    A new one formats its whole second once (the calls of one second share it) and adds the
    milliseconds: the text of `datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")`,
    in half the time."""
    if ts is None:
        return None
    second, micros = utc_parts(ts)
    return f"{second}.{micros // 1000:03d}Z"  # isoformat cuts to milliseconds


def utc_parts(ts: float) -> tuple[str, int]:
    """`ts` as its whole second's text (YYYY-MM-DDTHH:MM:SS, UTC) and its microseconds, rounded
    as `datetime.fromtimestamp` rounds: to the microsecond, half to even."""
    fraction, whole = math.modf(ts)
    micros = round(fraction * 1e6)
    if micros >= 1_000_000:
        micros, whole = micros - 1_000_000, whole + 1
    elif micros < 0:
        micros, whole = micros + 1_000_000, whole - 1
    return _second(int(whole)), micros


@functools.lru_cache(maxsize=64)
def _second(whole: int) -> str:
    return datetime.fromtimestamp(whole, UTC).isoformat()[:19]  # YYYY-MM-DDTHH:MM:SS
