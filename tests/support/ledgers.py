"""The ledger backends the contract suite runs on: one `ledger` fixture, parametrized over them.

Add a backend by naming it in BACKENDS and opening it in `open_backend`; every
test that asks for the `ledger` fixture (conftest.py) then runs on it too.
"""

from __future__ import annotations

from pathlib import Path

from commitgate.server.ledger.base import Ledger
from commitgate.server.ledger.sqlite import SQLiteLedger

BACKENDS: list[str] = ["sqlite", "postgres"]


async def open_backend(name: str, tmp_path: Path) -> Ledger:
    """A fresh, empty ledger of backend `name`, private to one test."""
    if name == "sqlite":
        return await SQLiteLedger.open(tmp_path / "ledger.db")
    if name == "postgres":  # a fresh schema; skips (fails under CI=true) without PostgreSQL
        from support.postgres import open_test_ledger

        return await open_test_ledger()
    raise ValueError(f"unknown ledger backend {name!r}; known: {', '.join(BACKENDS)}")
