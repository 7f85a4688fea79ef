"""PostgreSQL for tests: one throwaway database per test session, one fresh schema per ledger.

`fresh_url()` returns a URL whose `search_path` points at a new, empty schema
in a database created for this pytest process (`commitgate_test_<pid>_<hex>`),
dropped when the process exits. Databases left behind by killed runs on this
host are dropped on the next start.

`private_ledger()` gives a test a migrated, empty ledger and takes it back when the test is done:
emptied (every row deleted, every sequence restarted) and checked to hold exactly what a newly
migrated ledger holds (SCHEMA_OBJECTS), the next test gets it instead of a new schema. Migrating a
new schema costs PostgreSQL about 50 ms of CPU, emptying one a few; a ledger a test changed in
any other way (a function replaced, a trigger disabled, a table added) is left alone.

When PostgreSQL is not reachable the caller is skipped with the reason, except
under CI (`CI=true`), where it fails: CI must run these tests, not skip them.
The server is `COMMITGATE_TEST_POSTGRES` (default: trust auth on 127.0.0.1:5432).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from commitgate.server.ledger.postgres import PostgresLedger

ADMIN_URL = os.environ.get("COMMITGATE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
_PREFIX = "commitgate_test_"
_state: dict[str, str] = {}  # "database" -> name, "unreachable" -> reason
_emptied: list[str] = []  # URLs of ledgers given back emptied, each as a new one (`private_ledger`)
_new_ledger: list[str] = []  # SCHEMA_OBJECTS of a newly migrated ledger, once known

# What a schema holds, its name left out: relations, columns, indexes, constraints, triggers (and
# whether they fire), functions, and the schema versions recorded.
SCHEMA_OBJECTS = """
SELECT array_agg(replace(item, current_schema() || '.', '') ORDER BY item) FROM (
    SELECT concat_ws(' ', 'relation', relname, relkind, reloptions) FROM pg_class
        WHERE relnamespace = current_schema()::regnamespace
    UNION ALL SELECT 'function ' || pg_get_functiondef(p.oid) FROM pg_proc p
        WHERE p.pronamespace = current_schema()::regnamespace
    UNION ALL SELECT concat_ws(' ', 'column', c.relname, a.attnum, a.attname,
            format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid))
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = current_schema()::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
    UNION ALL SELECT 'index ' || pg_get_indexdef(i.indexrelid) FROM pg_index i
        JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relnamespace = current_schema()::regnamespace
    UNION ALL SELECT concat_ws(' ', 'constraint', conrelid::regclass, conname, pg_get_constraintdef(oid))
        FROM pg_constraint WHERE connamespace = current_schema()::regnamespace
    UNION ALL SELECT concat_ws(' ', 'trigger', pg_get_triggerdef(t.oid), t.tgenabled) FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = current_schema()::regnamespace
    UNION ALL SELECT 'version ' || version FROM commitgate_schema_version
) AS objects(item)
"""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _with_database(url: str, database: str, **settings: str) -> str:
    """`url` pointed at `database`, with `settings` as its query (asyncpg sends them as server settings)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(
        parts._replace(path="/" + database, query=urllib.parse.urlencode(settings))
    )


async def _admin() -> asyncpg.Connection:
    return await asyncpg.connect(ADMIN_URL, timeout=5)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _drop_leftovers(conn: asyncpg.Connection) -> None:
    """Databases of earlier runs whose process is gone (killed before its exit hook ran)."""
    for (name,) in await conn.fetch("SELECT datname FROM pg_database WHERE datname LIKE $1", _PREFIX + "%"):
        match = re.fullmatch(_PREFIX + r"(\d+)_[0-9a-f]+", name)
        if match and not _pid_alive(int(match.group(1))):
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _create_session_database() -> str:
    name = f"{_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}"
    conn = await _admin()
    try:
        await _drop_leftovers(conn)
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    atexit.register(_drop_session_database, name)
    return name


def _drop_session_database(name: str) -> None:
    async def drop() -> None:
        conn = await _admin()
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(drop())


async def require_postgres() -> str:
    """The session database's name; skips (fails under CI) when PostgreSQL is not reachable."""
    if "database" not in _state and "unreachable" not in _state:
        try:
            _state["database"] = await _create_session_database()
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            _state["unreachable"] = f"PostgreSQL not reachable at {ADMIN_URL}: {type(exc).__name__}: {exc}"
    if "unreachable" in _state:
        if in_ci():
            pytest.fail(f"{_state['unreachable']} (CI=true: PostgreSQL tests must run, not skip)")
        pytest.skip(_state["unreachable"])
    return _state["database"]


async def fresh_url() -> str:
    """A ledger URL on a new, empty schema of the session database."""
    database = await require_postgres()
    schema = "t_" + uuid.uuid4().hex[:12]
    conn = await asyncpg.connect(_with_database(ADMIN_URL, database), timeout=5)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()
    return _with_database(ADMIN_URL, database, search_path=schema)


async def open_test_ledger(**options: Any) -> PostgresLedger:
    """A fresh, empty PostgreSQL ledger private to one test (its schema dies with the session database)."""
    return await PostgresLedger.open(await fresh_url(), **options)


@asynccontextmanager
async def private_ledger(**options: Any) -> AsyncIterator[PostgresLedger]:
    """An empty ledger private to one test, closed and given back (see the module docstring) after."""
    url = _emptied.pop() if _emptied else await fresh_url()
    ledger = await PostgresLedger.open(url, **options)
    try:
        if not _new_ledger:  # nothing has touched it yet: what every ledger given back must hold
            _new_ledger.append(await _objects(url))
        yield ledger
    finally:
        await ledger.close()
        if await _empty(url):
            _emptied.append(url)


async def _objects(url: str) -> str:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        return str(await conn.fetchval(SCHEMA_OBJECTS))
    finally:
        await conn.close()


async def _empty(url: str) -> bool:
    """Empties the ledger at `url`; whether it then holds exactly what a new one holds (False, and
    it is left alone, when a test changed it otherwise or still holds a lock on it).

    DELETE, not TRUNCATE: a test leaves a few rows, and TRUNCATE would make new files for every
    table and index. Nothing here needs to outlive a crash, so the commit does not wait for the disk.
    """
    try:
        conn = await asyncpg.connect(url, timeout=5, server_settings={"lock_timeout": "2s"})
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return False
    try:
        async with conn.transaction():
            tables = await conn.fetchval(
                "SELECT string_agg(format('DELETE FROM %I;', relname), '') FROM pg_class"
                " WHERE relnamespace = current_schema()::regnamespace AND relkind = 'r'"
                " AND relname <> 'commitgate_schema_version'"
            )
            await conn.execute(f"SET LOCAL synchronous_commit = off; {tables}")
            await conn.execute(
                "SELECT setval(s.seqrelid, s.seqstart, false) FROM pg_sequence s JOIN pg_class c"
                " ON c.oid = s.seqrelid WHERE c.relnamespace = current_schema()::regnamespace"
            )
            return str(await conn.fetchval(SCHEMA_OBJECTS)) == _new_ledger[0]
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return False
    finally:
        await conn.close()


async def plan_on_fresh_ledger(query: str) -> str:
    """PostgreSQL's plan for `query` on a freshly migrated ledger, sequential scans discouraged.

    An empty table would be scanned whatever its indexes: this asks what the planner *can* use.
    """
    from commitgate.server.ledger.postgres import PostgresLedger

    url = await fresh_url()
    await (await PostgresLedger.open(url)).close()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SET enable_seqscan = off")
        rows = await conn.fetch("EXPLAIN " + query)
    finally:
        await conn.close()
    return "\n".join(r[0] for r in rows)
