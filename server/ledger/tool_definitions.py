"""The latest definition each upstream gave of each of its tools, kept in the ledger.

A wrapped tool is advertised from its upstream's own definition (title, description, schemas,
annotations, `_meta`) from the first `tools/list` after start, before the upstream has connected
again: `policy init` records what it listed, and a serving process records what it lists at every
connect. Kept in the ledger, so replicas on one PostgreSQL ledger share it.

One row per (upstream, tool): the definition as the upstream sent it (JSON, wire names) and when it
was recorded. Recording an upstream's tools replaces that upstream's rows: a tool it no longer
offers is forgotten. Both backends call into this module from two small methods of their own.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# Stored per upstream: tool name -> the definition as the upstream sent it (JSON, wire names).
Definitions = dict[str, dict[str, Any]]

SQLITE_MIGRATION = """
    CREATE TABLE IF NOT EXISTS tool_definitions (
        upstream TEXT NOT NULL,
        tool TEXT NOT NULL,
        definition TEXT NOT NULL,
        recorded_at REAL NOT NULL,
        PRIMARY KEY (upstream, tool)
    )
"""

POSTGRES_MIGRATION = """
    CREATE TABLE IF NOT EXISTS commitgate_tool_definitions (
        upstream TEXT NOT NULL,
        tool TEXT NOT NULL,
        definition TEXT NOT NULL,
        recorded_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (upstream, tool)
    );
"""


def _dump(definition: Mapping[str, Any]) -> str:
    return json.dumps(definition, sort_keys=True, separators=(",", ":"))


def grouped(rows: Iterable[tuple[str, str, str]]) -> dict[str, Definitions]:
    """(upstream, tool, definition JSON) rows as upstream -> tool -> definition."""
    found: dict[str, Definitions] = {}
    for upstream, tool, definition in rows:
        found.setdefault(upstream, {})[tool] = json.loads(definition)
    return found


def select_sql(table: str, count: int, *, numbered: bool) -> str:
    """The read of `count` upstreams' rows, in the backend's parameter style (`$1` or `?`)."""
    marks = ", ".join(f"${i + 1}" if numbered else "?" for i in range(count))
    return f"SELECT upstream, tool, definition FROM {table} WHERE upstream IN ({marks})"


def sqlite_record(upstream: str, tools: Definitions, now: float) -> Callable[[sqlite3.Connection], None]:
    """A writer function (run on the SQLite ledger's writer thread) replacing `upstream`'s rows."""

    def write(conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM tool_definitions WHERE upstream = ?", (upstream,))
        conn.executemany(
            "INSERT INTO tool_definitions (upstream, tool, definition, recorded_at) VALUES (?, ?, ?, ?)",
            [(upstream, name, _dump(definition), now) for name, definition in tools.items()],
        )

    return write


async def postgres_record(conn: Any, upstream: str, tools: Definitions, now: float) -> None:
    """Replace `upstream`'s rows in one transaction (asyncpg connection)."""
    async with conn.transaction():
        await conn.execute("DELETE FROM commitgate_tool_definitions WHERE upstream = $1", upstream)
        await conn.executemany(
            "INSERT INTO commitgate_tool_definitions (upstream, tool, definition, recorded_at)"
            " VALUES ($1, $2, $3, $4)",
            [(upstream, name, _dump(definition), now) for name, definition in tools.items()],
        )
