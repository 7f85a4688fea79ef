"""Shared test configuration: asyncio for anyio tests, a sandbox store and a system of record per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support_boundary import SystemOfRecord


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Points the demo tools' system of record at a fresh file for this test."""
    path = tmp_path / "sandbox.db"
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(path))
    monkeypatch.delenv("COMMITGATE_SANDBOX_FAULTS", raising=False)
    yield path


@pytest.fixture
def record(tmp_path: Path) -> SystemOfRecord:
    """A fresh system of record that counts effects (tests/support_boundary.py)."""
    return SystemOfRecord(tmp_path / "record.db")


# Modules that start real server processes; `make test-fast` leaves them out.
_PROCESS_MODULES = {
    "test_bench",
    "test_demo_command",
    "test_e2e_stdio",
    "test_fast_stdio",
    "test_http_transports",
    "test_multiprocess",
    "test_reload",
    "test_replicas_postgres",
    "test_saga",
    "test_upstream",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks what `make test-fast` skips: server processes (`slow`) and PostgreSQL (`postgres`)."""
    for item in items:
        if item.module is not None and item.module.__name__ in _PROCESS_MODULES:
            item.add_marker(pytest.mark.slow)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "postgres" in callspec.id:
            item.add_marker(pytest.mark.postgres)
