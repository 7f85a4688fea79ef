"""The audit event names written in SQL are the names Python knows (`AuditEvent`).

Python passes `AuditEvent` members to the ledger; a few PostgreSQL functions write their own
audit records with the name as an SQL literal. Every insert into the audit table, in every SQL
text of the ledger backends, is read here, and a literal event name must be a member.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from commitgate.server.model.audit import AuditEvent

LEDGER = Path(__file__).resolve().parent.parent / "server" / "ledger"
_INSERT = re.compile(
    r"INSERT INTO (?:commitgate_)?audit\s*\(([^)]*)\)\s*(VALUES\s*\(|SELECT\s)", re.IGNORECASE
)


def _texts(path: Path) -> list[str]:
    """Every string constant of a module, implicitly joined ones whole (as ast gives them)."""
    tree = ast.parse(path.read_text())
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def _items(text: str) -> list[str]:
    """The top-level comma-separated items at the start of `text`, up to the list's end."""
    items: list[str] = []
    depth, quoted, start = 0, False, 0
    for i, char in enumerate(text):
        if char == "'":
            quoted = not quoted
        elif quoted:
            continue
        elif char == "(":
            depth += 1
        elif char == ")" and depth == 0:
            return [*items, text[start:i].strip()]
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
        elif depth == 0 and text[i:].upper().startswith(" FROM "):
            return [*items, text[start:i].strip()]
    raise AssertionError(f"an audit insert without an end: {text[:200]!r}")


def audit_event_values() -> list[tuple[str, str]]:
    """(module, what the event column gets) for every audit insert in the ledger's SQL."""
    found = []
    for path in sorted(LEDGER.rglob("*.py")):
        for text in _texts(path):
            for match in _INSERT.finditer(text):
                columns = [c.strip() for c in match.group(1).split(",")]
                values = _items(text[match.end() :])
                assert len(values) == len(columns), (path.name, columns, values)
                found.append((path.name, values[columns.index("event")]))
    return found


def test_every_sql_audit_event_is_an_audit_event_member() -> None:
    found = audit_event_values()
    literals = {value.strip("'") for _, value in found if value.startswith("'")}
    # The parser reads what it must: the backends' own literals and their parameters.
    assert {
        "claimed",
        "lease_expired",
        "retry_claimed",
        "possible_duplicate",
        "approval_requested",
    } <= literals
    assert any(value == "p_event" for _, value in found) and any(value.startswith("?") for _, value in found)
    unknown = sorted(literals - {event.value for event in AuditEvent})
    assert not unknown, f"audit events in SQL that AuditEvent does not name: {unknown}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("INSERT INTO audit (a, event) VALUES (?, 'drifted')", "'drifted'"),
        ("INSERT INTO commitgate_audit (event, b) SELECT 'x', f(1, 2) FROM t", "'x'"),
        ("INSERT INTO audit (a, event, b) VALUES ((c.op).id, p_event, json_build_object('k', 1))", "p_event"),
    ],
)
def test_the_reader_finds_the_event_column(text: str, expected: str) -> None:
    match = _INSERT.search(text)
    assert match is not None
    columns = [c.strip() for c in match.group(1).split(",")]
    assert _items(text[match.end() :])[columns.index("event")] == expected


def test_audit_events_are_distinct_lowercase_names() -> None:
    values = [event.value for event in AuditEvent]
    assert len(values) == len(set(values))
    assert all(re.fullmatch(r"[a-z_]+", value) for value in values)
