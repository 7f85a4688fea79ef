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
