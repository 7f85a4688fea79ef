"""Structured logs: one JSON object per line on stderr (never stdout: under stdio it carries MCP).

What is logged: each answered `tools/call` (tool, class, principal, answer
code, operation id, state, replayed, attempts, duration) on `commitgate.calls`,
and each boundary event (replay, retry, reconciliation, completion with its
state, lease expiry...) on `commitgate.events`, both at INFO.

What is never logged unless `configure_logging(unredacted=True)` (the CLI's
`--debug-unredacted`): argument values, error messages (they may quote
arguments), and anything other libraries log below INFO — the MCP SDK's
DEBUG records dump whole JSON-RPC messages. Without the flag, records of
other libraries that interpolate arguments keep only their template,
exceptions keep their type and frames but not their message, and uvicorn's
access lines lose their query strings. With it, call lines also carry the
call's arguments and error message. Results and tokens are never logged.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from datetime import UTC, datetime
from typing import IO, Any

from commitgate.server.model.events import BoundaryEvent, CallAnswered, Event

EVENTS = logging.getLogger("commitgate.events")
CALLS = logging.getLogger("commitgate.calls")

_OURS = "commitgate"
_TRUSTED = frozenset({"uvicorn.error", "py.warnings"})  # lifecycle messages and warnings from code
_FIELD = "commitgate"  # the `extra` attribute carrying structured fields
# An event's fields written only unredacted: a scope may name a principal or a session, an amount
# comes from the arguments. (An event has no field for arguments, results, messages or keys.)
_UNSAFE_FIELDS = frozenset({"amount", "scope"})
# Every event at INFO but these: a person should look at the first, the second is one per attempt.
_LEVELS = {
    Event.LEASE_EXPIRED: logging.WARNING,
    Event.LEDGER_UNAVAILABLE: logging.WARNING,
    Event.RESULT_TOO_LARGE: logging.WARNING,
    Event.ATTEMPT: logging.DEBUG,
}

_state = {"unredacted": False}


def unredacted() -> bool:
    return _state["unredacted"]


class JsonFormatter(logging.Formatter):
    def __init__(self, *, unredacted: bool = False) -> None:
        super().__init__()
        self.unredacted = unredacted

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        out.update(self._message(record))
        fields = getattr(record, _FIELD, None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info and record.exc_info[0] is not None:
            out.update(self._exception(record))
        return json.dumps(out, default=str, ensure_ascii=False, separators=(",", ":"))

    def _message(self, record: logging.LogRecord) -> dict[str, Any]:
        if self.unredacted or _is_ours(record.name) or record.name in _TRUSTED or not record.args:
            return {"msg": record.getMessage()}
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, _, status = record.args
            path = str(path).split("?")[0]
            return {"msg": "request", "client": client, "method": method, "path": path, "status": status}
        return {"msg": str(record.msg), "redacted": True}

    def _exception(self, record: logging.LogRecord) -> dict[str, Any]:
        kind, _, tb = record.exc_info or (None, None, None)
        assert kind is not None
        if self.unredacted:
            return {"exc_type": kind.__name__, "exc": self.formatException(record.exc_info)}  # type: ignore[arg-type]
        frames = [f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_tb(tb)]
        return {"exc_type": kind.__name__, "frames": frames[-8:]}


def _is_ours(name: str) -> bool:
    return name == _OURS or name.startswith(_OURS + ".")


class _ForeignDebugFilter(logging.Filter):
    """Drops other libraries' DEBUG records (the MCP SDK's dump whole messages)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO or _is_ours(record.name)


def configure_logging(
    level: str = "warning", *, unredacted: bool = False, stream: IO[str] | None = None
) -> None:
    """JSON lines on stderr for every logger; replaces the root logger's handlers."""
    _state["unredacted"] = unredacted
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(unredacted=unredacted))
    if not unredacted:
        handler.addFilter(_ForeignDebugFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # SDK deprecation warnings become records too, not raw stderr text


def extra(**fields: Any) -> dict[str, Any]:
    """`logger.info(msg, extra=extra(k=v))`: fields written as top-level keys of the JSON line."""
    return {_FIELD: fields}


def _safe(fields: dict[str, object]) -> dict[str, object]:
    keep = unredacted()
    return {
        k: v
        for k, v in fields.items()
        if (keep or k not in _UNSAFE_FIELDS) and (v is None or isinstance(v, str | int | float | bool))
    }


def log_event(event: BoundaryEvent) -> None:
    """An `Observer`: each boundary event as one JSON line on commitgate.events."""
    level = _LEVELS.get(event.kind, logging.INFO)
    if not EVENTS.isEnabledFor(level):
        return
    record = {"event": event.kind, "tool": event.tool, "class": event.cls.value, **_safe(event.details())}
    EVENTS.log(level, event.kind, extra=extra(**record))


def log_call(event: CallAnswered) -> None:
    """A `CallObserver`: one answered tools/call as one JSON line on commitgate.calls.

    Its message (may quote arguments) and arguments are written only when unredacted.
    """
    if not CALLS.isEnabledFor(logging.INFO):
        return
    record: dict[str, Any] = {
        "event": "call",
        "tool": event.tool,
        "class": event.cls,
        "principal": event.principal,
        "code": event.code,
        "seconds": round(event.seconds, 6),
    }
    op = event.operation
    if op is not None:
        record["operation_id"] = op.operation_id
        record["state"] = op.state.value
        record["replayed"] = event.replayed
        record["attempts"] = op.attempts
    if unredacted():
        if event.message is not None:
            record["message"] = event.message
        if event.arguments is not None:
            record["arguments"] = event.arguments
    CALLS.info("call", extra=extra(**record))
