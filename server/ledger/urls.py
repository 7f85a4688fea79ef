"""Ledger URLs, read in one place: which backend a URL names and where its data lives.

The SQLAlchemy convention: `sqlite:///relative.db`, `sqlite:////absolute/path.db`,
`postgresql://user@host/db` (also `postgres://`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

_SQLITE = "sqlite:///"
_POSTGRES = ("postgresql://", "postgres://")
FORMS = "sqlite:///relative.db, sqlite:////absolute/path.db or postgresql://user@host/db"


class Backend(StrEnum):
    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"


@dataclass(frozen=True, slots=True)
class LedgerURL:
    url: str
    backend: Backend

    @property
    def sqlite_path(self) -> Path:
        """The database file of a SQLite URL (relative to the working directory unless absolute)."""
        if self.backend is not Backend.SQLITE:
            raise ValueError(f"not a SQLite ledger URL: use {FORMS}")
        return Path(self.url[len(_SQLITE) :])


def parse_ledger_url(url: str) -> LedgerURL:
    """The backend `url` names; ValueError that says which forms are accepted otherwise."""
    if url.startswith(_SQLITE) and len(url) > len(_SQLITE):
        return LedgerURL(url, Backend.SQLITE)
    if url.startswith(_POSTGRES):
        return LedgerURL(url, Backend.POSTGRESQL)
    raise ValueError(f"use {FORMS}")
