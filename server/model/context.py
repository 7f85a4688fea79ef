"""What a tool learns about the operation it runs in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OperationContext:
    """Injected into a tool parameter annotated with this type (never part of the schema)."""

    idempotency_key: str | None
    session: str
    operation_id: str | None
    attempt: int
    principal: str
    tool: str = ""
