"""The ledger backends the contract suite runs on: one `ledger` fixture, parametrized over them.

Add a backend by naming it in BACKENDS and opening it in `open_backend`; every
test that asks for `ledger` then runs on it too. Test modules load this file with
`pytest_plugins = ["ledger_backends"]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from commitgate.server.ledger.base import Ledger
from commitgate.server.ledger.sqlite import SQLiteLedger

BACKENDS: list[str] = ["sqlite", "postgres"]


async def open_backend(name: str, tmp_path: Path) -> Ledger:
    """A fresh, empty ledger of backend `name`, private to one test."""
    if name == "sqlite":
        return await SQLiteLedger.open(tmp_path / "ledger.db")
    if name == "postgres":  # a fresh schema; skips (fails under CI=true) without PostgreSQL
        from pg_support import open_test_ledger

        return await open_test_ledger()
    raise ValueError(f"unknown ledger backend {name!r}; known: {', '.join(BACKENDS)}")


@pytest.fixture(params=BACKENDS)
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Ledger]:
    backend = await open_backend(request.param, tmp_path)
    try:
        yield backend
    finally:
        await backend.close()
