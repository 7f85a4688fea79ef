"""Pages from templates: one Jinja environment that escapes every value, and how operations are shown.

Everything an agent or a client sent (sessions, keys, arguments, results, error texts) reaches a
template as data and is escaped there; nothing is marked safe. Secret-looking fields are masked
before they reach a template at all (policy/masking.py: credentials hidden, card numbers cut to
their last four digits).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import HTMLResponse

from commitgate.server.cli.shown import visible
from commitgate.server.ledger.base import AuditEntry
from commitgate.server.model.audit import Actor
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ReconciliationNote
from commitgate.server.model.outcomes import Verdict
from commitgate.server.model.records import Operation, ToolResult
from commitgate.server.policy.masking import mask_values

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"


def _shown(value: Any) -> Any:
    """Every value a template prints: invisible and bidirectional characters (U+200B, U+202E...)
    written as escapes, as `ops show` does, so text cannot hide or reorder what a person reads.
    Markup is a template's own output, already shown this way."""
    return visible(value) if isinstance(value, str) and not isinstance(value, Markup) else value


_environment = Environment(
    loader=FileSystemLoader(TEMPLATES),
    autoescape=True,  # every template, whatever its name: nothing from a client is ever trusted
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    finalize=_shown,
)


def moment(ts: float | None) -> str:
    """A time as people read it in a list: UTC, to the second."""
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso_time(ts: float | None) -> str:
    return "" if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def shown_json(value: Any) -> str:
    """Masked, indented JSON for a <pre> block (escaped by the template, like every value)."""
    return json.dumps(mask_values(value), indent=2, ensure_ascii=False, sort_keys=True, default=str)


def compact_json(value: Any) -> str:
    return json.dumps(mask_values(value), ensure_ascii=False, sort_keys=True, default=str)


def shown_result(result: ToolResult | None) -> str | None:
    """A result's structured content, or its text blocks (JSON text is masked like any value)."""
    if result is None:
        return None
    if result.structured is not None:
        return shown_json(result.structured)
    texts = [block.get("text", "") for block in result.content if block.get("type") == "text"]
    parts = []
    for text in texts:
        try:
            parts.append(shown_json(json.loads(text)))
        except ValueError:
            parts.append(str(mask_values(text)))
    return "\n".join(parts) or shown_json(result.content)


def status_check(op: Operation) -> str | None:
    """What the status check said about an operation, in a sentence; None when nobody asked."""
    note = op.reconciliation or ReconciliationNote(None)
    verdict = note.verdict
    if note.by == "operator":
        return f"resolved by {note.operator}: {note.reason}"
    if verdict == Verdict.CANNOT_TELL:
        return f"the status check could not tell: {mask_values(str(note.error or 'no reason given'))}"
    if verdict == Verdict.NOT_FOUND:
        return "the status check found no trace of it"
    if verdict == Verdict.FOUND:
        return "the status check found it in the system of record"
    if op.state is not State.UNKNOWN:
        return None
    if op.idempotency_class is IdempotencyClass.KEY_AND_STATUS_CHECK:
        return "the status check has not answered yet"
    return f"no status check: a {op.idempotency_class.value} tool cannot be asked, so a person decides"


def dated(value: Any) -> Any:
    """`value` with every time the ledger keeps as seconds (`at`, `decided_at`...) as a UTC date."""
    if isinstance(value, dict):
        return {
            key: moment(item)
            if (key == "at" or str(key).endswith("_at")) and isinstance(item, int | float)
            else dated(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [dated(item) for item in value]
    return value


def actor_of(entry: AuditEntry, principal: str) -> str:
    """Who acted: the principal (its call), `commitgate` (on its own) or an operator (a decision);
    never the internal owner id of a server process."""
    return Actor.of_record(entry.actor, entry.event, principal).shown


def history_rows(entries: list[AuditEntry], principal: str) -> list[dict[str, Any]]:
    return [
        {
            "at": moment(entry.at),
            "iso": iso_time(entry.at),
            "event": entry.event,
            "change": " → ".join(s for s in (entry.from_state, entry.to_state) if s),
            "attempt": entry.fence,
            "actor": actor_of(entry, principal),
            "detail": compact_json(dated(entry.detail)) if entry.detail else "",
        }
        for entry in entries
    ]


def render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """A page in the console's layout: navigation, who is signed in, and the form token."""
    identity = getattr(request.state, "identity", None)
    access = request.app.state.access
    values = {
        "pages": request.app.state.pages,
        "current": request.url.path,
        "identity": identity,
        "csrf_token": access.csrf_token(identity) if identity is not None else "",
        "moment": moment,
        "iso_time": iso_time,
        "compact_json": compact_json,
        "shown_json": shown_json,
        **context,
    }
    html = _environment.get_template(template).render(values)
    return HTMLResponse(html, status_code=status_code)
