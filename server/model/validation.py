"""How argument validation failures read: one line that names each field and what is wrong with it."""

from __future__ import annotations

from pydantic import ValidationError


def describe(error: ValidationError) -> str:
    """`amount_cents: Input should be a valid integer; colour: unknown argument` for a model or tool."""
    parts = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "(arguments)"
        message = "unknown argument" if item["type"] == "extra_forbidden" else item["msg"]
        parts.append(f"{field}: {message}")
    return "; ".join(parts)
