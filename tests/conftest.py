"""Shared test configuration: asyncio for anyio tests, a sandbox store and a system of record per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.boundary import SystemOfRecord
from support.ledgers import BACKENDS, backend

from commitgate.server.ledger.base import Ledger


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio for every anyio test; module scope, so module-scoped servers live across a module's tests."""
    return "asyncio"


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Points the demo tools' system of record at a fresh file for this test."""
    path = tmp_path / "sandbox.db"
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(path))
    monkeypatch.delenv("COMMITGATE_SANDBOX_FAULTS", raising=False)
    return path


@pytest.fixture
def record(tmp_path: Path) -> SystemOfRecord:
    """A fresh system of record that counts effects (tests/support/boundary.py)."""
    return SystemOfRecord(tmp_path / "record.db")


# Modules that start real server processes; `make test-fast` leaves them out.
_PROCESS_MODULES = {
    "test_agent_eval",
    "test_bad_inputs",
    "test_bench",
    "test_conformance",
    "test_console_browser",
    "test_demo_command",
    "test_e2e_stdio",
    "test_fast_stdio",
    "test_fencing",
    "test_hardening_processes",
    "test_ledger_damage",
    "test_http_transports",
    "test_init_hostile",
    "test_init_rerun",
    "test_model_facing",
    "test_multiprocess",
    "test_name_classes",
    "test_reload",
    "test_policy_init",
    "test_replicas_postgres",
    "test_saga",
    "test_tracing_otlp",
    "test_upstream",
    "test_upstream_definitions",
    "test_upstream_errors",
    "test_verify",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks what `make test-fast` skips: server processes (`slow`) and PostgreSQL (`postgres`)."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ in _PROCESS_MODULES:
            item.add_marker(pytest.mark.slow)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "postgres" in callspec.id:
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(params=BACKENDS)
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Ledger]:
    """A fresh, empty ledger on each backend of support/ledgers.py in turn."""
    async with backend(request.param, tmp_path) as opened:
        yield opened
