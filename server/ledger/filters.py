"""An `OperationFilter` as SQL terms, shared by the SQL backends (each places its own placeholders)."""

from __future__ import annotations

from typing import Any

from commitgate.server.ledger.base import OperationFilter


def filter_terms(where: OperationFilter) -> list[tuple[str, Any]]:
    """(SQL with one `{}` for the backend's placeholder, value) for each condition the filter sets."""
    equal = (
        ("principal", where.principal),
        ("session", where.session),
        ("state", where.state.value if where.state else None),
        ("tool", where.tool),
        ("step", where.step),
    )
    terms: list[tuple[str, Any]] = [
        (f"{column} = {{}}", value) for column, value in equal if value is not None
    ]
    if where.older_than is not None:
        terms.append(("updated_at <= {}", where.older_than))
    if where.approval_due_by is not None:
        terms.append(("approval_expires_at <= {}", where.approval_due_by))
    return terms
