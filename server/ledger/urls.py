"""Ledger URLs, read in one place: which backend a URL names and where its data lives.

The SQLAlchemy convention: `sqlite:///relative.db`, `sqlite:////absolute/path.db`,
`postgresql://user@host/db` (also `postgres://`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

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


_HOST_PORT = re.compile(r"^(?P<host>\[[^\]]*\]|[^:\[\]]*)(?::(?P<port>[^:]*))?$")


def check_postgres_url(url: str) -> None:
    """Raise ValueError naming the part of a postgresql:// URL that cannot work."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 address
        raise ValueError(f"malformed ledger URL: {exc}; write e.g. postgresql://user@[::1]:5432/db") from None
    hosts = netloc.rpartition("@")[2]
    for spec in hosts.split(",") if hosts else []:
        match = _HOST_PORT.match(spec)
        if match is None:
            raise ValueError(
                f"malformed host {spec!r} in the ledger URL: put an IPv6 address in brackets, e.g. [::1]:5432"
            )
        port = match.group("port")
        if port is not None and not (port.isdigit() and 0 < int(port) <= 65535):
            raise ValueError(f"the ledger URL's port {port!r} is not a port number (1-65535)")
