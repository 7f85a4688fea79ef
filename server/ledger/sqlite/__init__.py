"""SQLite ledger: WAL, synchronous=FULL, one writer thread with group commit.

Every ledger write is one function run on a dedicated writer thread, so a claim
or an outcome costs one thread hop, not one per statement. The writer drains
whatever writes are queued and commits them in one transaction (group commit):
under concurrency many writes share one fsync. Consecutive claims of new keys,
and consecutive plain outcomes, run as one statement per table for the whole
run (`run_many`), falling back to one by one whenever a write needs its own
decision. A failing write never takes the others of its batch down: the batch
then runs again with each write in a savepoint. An operation alone in its
process runs its writes on the caller's thread, on a second connection that
never waits (`run_inline`); a replay is answered by one read on that same
connection while the writer is idle. Reads that need no write (status,
listings) go through an aiosqlite connection, which WAL lets run beside the
writer, and a checkpointer thread copies the WAL back off the commit path.

Several processes may share one file: BEGIN IMMEDIATE serialises writers
across processes, and the unique (principal, session, step) index makes the
claim exactly-once.

Here: the Ledger interface. `_writer.py`: the writer and checkpointer threads.
`_writes.py`: what a claim or an outcome does to the database. `_schema.py`: the
tables, their migrations and how a row becomes an Operation. `_ids.py`: new
operation ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import aiosqlite

from commitgate.server.ledger import evidence
from commitgate.server.ledger.base import (
    BUDGET_STATES,
    AuditEntry,
    Claim,
    ClaimKind,
    ClaimRequest,
    Counts,
    Lease,
    LedgerUnavailable,
    OperationFilter,
    OverBudget,
    Spent,
    SpentIn,
    StepTimer,
    Transition,
    is_outcome,
    lease_over,
    sql_state,
    sql_states,
    timed,
)
from commitgate.server.ledger.evidence import Evidence, OutboxItem, Settled
from commitgate.server.ledger.filters import filter_terms
from commitgate.server.ledger.sqlite._schema import (
    COMPLETED,
    COUNTS_BY_STATE,
    EXPIRES_AT,
    FINGERPRINT,
    MIGRATIONS,
    OPEN,
    SELECT,
    STATE,
    TOOL,
    decode,
    foreign,
    migrate,
    read_only_uri,
)
from commitgate.server.ledger.sqlite._writer import Writer
from commitgate.server.ledger.sqlite._writes import SETTLED, ClaimWrite, OutcomeWrite, to_unknown
from commitgate.server.ledger.tool_definitions import Definitions, grouped, select_sql, sqlite_record
from commitgate.server.model.amounts import joined
from commitgate.server.model.facts import State
from commitgate.server.model.receipts import at_text, digest
from commitgate.server.model.records import Operation

T = TypeVar("T")

log = logging.getLogger("commitgate.ledger")


def _create_private(path: Path) -> None:
    """The ledger holds arguments and results: owner-only, from the first byte."""
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class SQLiteLedger:
    """A ledger in one SQLite file; see the module docstring for how writes are batched."""

    def __init__(self, path: Path, writer: Writer | None, reader: aiosqlite.Connection) -> None:
        self.path = path
        self._writer_or_none = writer  # None: opened read-only (see `open_read_only`)
        self._reader = reader
        self.inline_when_alone = True  # see `_write`
        self._open: set[str] = set()  # operations this process claimed and has not finished
        self._where = os.path.abspath(path)  # a later chdir must not move the file we check
        self._identity = _identity(self._where)
        self._lost = False  # the file left its path; said once in the log, until it is back
        self.timer: StepTimer | None = None  # see `timed`

    def check_identity(self) -> None:
        """Refuse to record into a file that is no longer the one at the path.

        A ledger deleted, renamed or replaced under a running server would otherwise take claims
        into an unlinked inode that nobody reads again: after a restart the same key runs twice.
        One stat of the path before a claim is written suffices: our open connections keep the
        file's inode allocated, so a file at the path with its (device, inode) is that very file,
        and an unlinked one has no path to match. A claim made while the writer is idle checks on
        the caller's thread; under load the writer checks once per batch, before writing it. (A
        stat gives up the GIL, and a busy writer takes it then: on the event loop, one stat per
        claim cost a wait for the writer's Python turn each.)
        """
        try:
            same = _identity(self._where) == self._identity
        except OSError:
            same = False
        if same:
            if self._lost:
                self._lost = False
                log.warning("the ledger file %s is back at its path; recording again", self._where)
            return
        if not self._lost:
            self._lost = True
            log.error(
                "the ledger file %s was deleted, renamed or replaced while serving; keyed calls are refused"
                " (nothing runs) until it is back or the server restarts",
                self._where,
            )
        raise LedgerUnavailable("the ledger file was deleted, renamed or replaced while serving")

    @property
    def _writer(self) -> Writer:
        if self._writer_or_none is None:
            raise LedgerUnavailable("this ledger was opened read-only")
        return self._writer_or_none

    @classmethod
    async def open_read_only(cls, path: Path | str, busy_timeout_ms: int = 5000) -> SQLiteLedger:
        """For commands that only read: nothing is created, migrated or switched to WAL."""
        path = Path(path).expanduser()
        if not path.exists():
            raise LedgerUnavailable(f"no ledger at {path} (nothing has been recorded there)")
        reason = foreign(path)
        if reason is not None:
            raise LedgerUnavailable(f"{path} is not a commitgate ledger: {reason}")
        reader = await aiosqlite.connect(read_only_uri(path), uri=True)
        ledger = cls(path, None, reader)
        try:
            await reader.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            rows = await ledger._read("SELECT name FROM sqlite_master WHERE type = 'table'", ())
            if not {row[0] for row in rows}:
                raise LedgerUnavailable(f"no ledger at {path} yet (the file is empty)")
            version = (await ledger._read("SELECT max(version) FROM schema_version", ()))[0][0] or 0
            if version != len(MIGRATIONS):
                raise LedgerUnavailable(
                    f"{path} is a commitgate ledger of schema version {version}, this commitgate reads"
                    f" version {len(MIGRATIONS)}: {'upgrade commitgate' if version > len(MIGRATIONS) else 'start a server on it once to migrate it'}"
                )
        except BaseException:
            await reader.close()
            raise
        return ledger

    @classmethod
    async def open(
        cls,
        path: Path | str,
        *,
        synchronous: str = "FULL",
        busy_timeout_ms: int = 5000,
        durability: str = "full",
        outcome_sync_within: float = 0.05,
    ) -> SQLiteLedger:
        """`durability = "claim"`: outcomes commit without a sync of their own (see `Writer`)."""
        path = Path(path).expanduser()
        if synchronous.upper() not in ("FULL", "NORMAL", "EXTRA", "OFF"):
            raise ValueError(f"synchronous must be FULL, NORMAL, EXTRA or OFF, not {synchronous!r}")
        if durability not in ("full", "claim"):
            raise ValueError(f"durability must be 'full' or 'claim', not {durability!r}")
        reason = foreign(path)  # before anything writes: WAL mode alone would change the file
        if reason is not None:
            raise LedgerUnavailable(f"{path} is not a commitgate ledger: {reason}")
        try:
            _create_private(path)
            lazy_within = outcome_sync_within if durability == "claim" else None
            writer = Writer(path, synchronous.upper(), busy_timeout_ms, lazy_within)
        except (OSError, sqlite3.Error) as exc:
            raise LedgerUnavailable(f"cannot open ledger {path}: {exc}") from exc
        writer.start()
        ledger = cls(path, writer, await aiosqlite.connect(path))
        writer.precheck = ledger.check_identity
        try:
            await ledger._reader.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            await ledger._write(migrate)
        except BaseException:  # e.g. a schema newer than this code: never leave threads behind
            await ledger.close()
            raise
        return ledger

    async def _write(self, write: Callable[[sqlite3.Connection], T], *, alone: bool = False) -> T:
        """One ledger write. `alone`: no other operation of this process is in flight, so there is no
        group to commit with; run it on this thread if the writer is idle (no thread hop). With
        company it goes to the writer, whose next batch commits it with the others."""
        if alone and self.inline_when_alone:
            ran, value = self._writer.run_inline(write)
            if ran:
                return cast(T, value)  # ran => the write's own value
        return await self._writer.submit(write)

    @timed
    async def claim(self, request: ClaimRequest, now: float) -> Claim:
        # A replay is answered by one read outside any transaction: cheaper than the write
        # transaction a claim write takes even inline. Under load the writer hop is shared with a whole batch anyway,
        # and a read beside a busy writer contends with it (WAL read locks, the GIL) while most
        # claims are of new keys and find nothing: then go straight to the writer.
        settled: Claim | None = None
        absent = False  # the read found no row under this key: the write may skip reading it again
        alone = not self._open and self.inline_when_alone
        idle = not self._writer.busy
        if idle:
            self.check_identity()  # busy: the writer checks once for its whole batch (`Writer.precheck`)
            settled, absent = self._settled(request, now)
        claim = (
            settled
            if settled is not None
            else await self._write(ClaimWrite(request, now, absent, checked=idle), alone=alone)
        )
        if isinstance(claim, OverBudget):
            raise claim
        if claim.kind is ClaimKind.NEW:
            self._open.add(claim.operation.operation_id)
        if alone and settled is None:
            # Written inline without yielding: let other tasks in now, with this operation already
            # counted as open, so that theirs go to the writer and company (batching) forms. An
            # outcome needs no such turn: its caller answers next, which yields anyway.
            await asyncio.sleep(0)
        return claim

    def _settled(self, request: ClaimRequest, now: float) -> tuple[Claim | None, bool]:
        """A replay or a conflict, answered from one indexed read without the writer thread; and
        whether the key had no row at all.

        A settled operation changes only by compensation or purge, so a committed WAL snapshot
        answers it as the writer would (the read takes no lock and never waits for writers);
        anything else, or any error, takes the writer's path.
        """
        try:
            row = self._writer.read_inline(
                f"{SELECT} WHERE principal = ? AND session = ? AND step = ?",
                (request.principal, request.session, request.step),
            )
        except sqlite3.Error:
            return None, False
        if row is None:
            return None, True
        if row[EXPIRES_AT] is not None and row[EXPIRES_AT] <= now:  # past retention: the write deletes it
            return None, False
        if row[TOOL] != request.tool or row[FINGERPRINT] != request.fingerprint:
            return Claim(ClaimKind.CONFLICT, decode(row)), False
        if row[STATE] in SETTLED:
            return Claim(ClaimKind.EXISTING, decode(row)), False
        return None, False

    @timed
    async def update(
        self, operation_id: str, change: Transition, now: float, *, current: Operation | None = None
    ) -> Operation | None:
        alone = self._open <= {operation_id}
        write = OutcomeWrite(operation_id, change, now, current)
        # An outcome lost to a power loss leaves its operation RUNNING, so UNKNOWN once its lease is
        # over: never run twice. Such a write may wait for the next sync when the policy says so.
        write.lazy = self._writer.lazy_outcomes and is_outcome(change)
        updated = await self._write(write, alone=alone)
        if isinstance(updated, OverBudget):  # a take whose budget has no room: nothing was taken
            raise updated
        if updated is not None:
            if updated.state is State.RUNNING:
                self._open.add(operation_id)
            else:
                self._open.discard(operation_id)
        return updated

    @timed
    async def renew_lease(self, operation_id: str, fence: int, lease: Lease) -> bool:
        def write(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE operations SET lease_owner = ?, lease_expires_at = ?"
                f" WHERE operation_id = ? AND fence = ? AND state = {sql_state(State.RUNNING)}",
                (lease.owner, lease.expires_at, operation_id, fence),
            )
            return cursor.rowcount == 1

        return await self._write(write)

    async def _read(self, sql: str, params: Sequence[Any]) -> list[Any]:
        try:
            return list(await self._reader.execute_fetchall(sql, params))
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"ledger read failed: {exc}") from exc

    @timed
    async def get(self, principal: str, session: str, step: str) -> Operation | None:
        rows = await self._read(
            f"{SELECT} WHERE principal = ? AND session = ? AND step = ?", (principal, session, step)
        )
        return decode(rows[0]) if rows else None

    @timed
    async def get_by_id(self, principal: str | None, operation_id: str) -> Operation | None:
        rows = await self._read(f"{SELECT} WHERE operation_id = ?", (operation_id,))
        if not rows:
            return None
        op = decode(rows[0])
        return op if principal is None or op.principal == principal else None

    @timed
    async def find(self, where: OperationFilter) -> list[Operation]:
        terms = filter_terms(where)
        clauses = [condition.format("?") for condition, _ in terms]
        if where.state is not None:  # the index of its state's records, open or completed
            clauses.append(COMPLETED if where.state.terminal else OPEN)
        params = [value for _, value in terms]
        sql = SELECT + (" WHERE " + " AND ".join(clauses) if clauses else "")
        sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        params.append(where.limit)
        return [decode(row) for row in await self._read(sql, params)]

    @timed
    async def history(self, operation_id: str) -> list[AuditEntry]:
        rows = await self._read(
            "SELECT at, event, from_state, to_state, fence, actor, detail FROM audit WHERE operation_id = ?"
            " ORDER BY id",
            (operation_id,),
        )
        return [
            AuditEntry(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]) if r[6] else None) for r in rows
        ]

    @timed
    async def expire_leases(self, now: float) -> list[Operation]:
        def write(conn: sqlite3.Connection) -> list[Operation]:
            rows = conn.execute(f"{SELECT} WHERE state = {sql_state(State.RUNNING)} AND {OPEN}").fetchall()
            expired = [op for op in map(decode, rows) if lease_over(op, now)]
            for op in expired:
                to_unknown(conn, op, now)
            return expired

        return await self._write(write)

    @timed
    async def purge(self, now: float) -> int:
        def write(conn: sqlite3.Connection) -> int:
            doomed = "SELECT operation_id FROM operations WHERE expires_at IS NOT NULL AND expires_at <= ?"
            conn.execute(f"DELETE FROM audit WHERE operation_id IN ({doomed})", (now,))
            return conn.execute(
                "DELETE FROM operations WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            ).rowcount

        return await self._write(write)

    @timed
    async def counts(self) -> Counts:
        states = {state.value: 0 for state in State}
        for state, n in await self._read(COUNTS_BY_STATE, ()):
            states[state] += n
        events = dict(await self._read("SELECT event, count(*) FROM audit GROUP BY event", ()))
        return Counts(states, events)

    @timed
    async def budget_spent(self, budget: str, per: str, since: float, now: float) -> list[Spent]:
        columns = {"all": "NULL, NULL", "principal": "principal, NULL", "session": "principal, session"}[per]
        rows = await self._read(
            f"SELECT {columns}, sum(budget_units), sum(budget_nanos), count(*) FROM operations"
            " INDEXED BY operations_budget WHERE budget = ? AND budget_spent_at > ?"
            f" AND state IN ({sql_states(BUDGET_STATES)})"
            " AND (expires_at IS NULL OR expires_at > ?) GROUP BY 1, 2",
            (budget, since, now),
        )
        spent = [Spent(r[0], r[1], joined(r[2], r[3]), int(r[4])) for r in rows if r[4]]
        return sorted(spent, key=lambda s: s.spent, reverse=True)

    @timed
    async def budget_spending(
        self,
        budget: str,
        principal: str | None,
        session: str | None,
        since: float,
        now: float,
        span_seconds: float,
    ) -> list[SpentIn]:
        scope, params = "", [span_seconds, budget, since, now]
        if principal is not None:
            scope, params = " AND principal = ?", [*params, principal]
            if session is not None:
                scope, params = scope + " AND session = ?", [*params, session]
        # budget_spent_at > since > 0, so the cast's truncation is the floor: whole spans since the epoch
        rows = await self._read(
            "SELECT CAST(budget_spent_at / ? AS INTEGER), sum(budget_units), sum(budget_nanos), count(*)"
            " FROM operations INDEXED BY operations_budget WHERE budget = ? AND budget_spent_at > ?"
            f" AND state IN ({sql_states(BUDGET_STATES)})"
            f" AND (expires_at IS NULL OR expires_at > ?){scope} GROUP BY 1 ORDER BY 1",
            params,
        )
        return [SpentIn(r[0] * span_seconds, joined(r[1], r[2]), int(r[3])) for r in rows]

    @timed
    async def tool_definitions(self, upstreams: Sequence[str]) -> dict[str, Definitions]:
        """The latest definitions of `upstreams`' tools (server/ledger/tool_definitions.py)."""
        sql = select_sql("tool_definitions", len(upstreams), numbered=False)
        return grouped(await self._read(sql, list(upstreams))) if upstreams else {}

    async def record_tool_definitions(self, upstream: str, tools: Definitions, now: float) -> None:
        await self._write(sqlite_record(upstream, tools, now))

    async def check_writable(self) -> None:
        self.check_identity()
        await self._write(lambda conn: conn.execute("CREATE TEMP TABLE IF NOT EXISTS _probe (x)"))

    # --- receipts and the outbox (ledger/evidence.py) -------------------------------------------

    def attach(self, evidence: Evidence) -> None:
        self._writer.attach(evidence)

    async def outbox_take(self, owner: str, now: float, lease: float, limit: int) -> list[OutboxItem]:
        if not await self._read(evidence.ANY_DUE, (now, now)):  # a read: no write lock while idle
            return []
        return await self._write(lambda conn: evidence.sqlite_take(conn, owner, now, lease, limit))

    async def outbox_settle(self, item: OutboxItem, owner: str, settled: Settled) -> bool:
        return await self._write(lambda conn: evidence.sqlite_settle(conn, item, owner, settled))

    async def undelivered(self) -> list[OutboxItem]:
        return [evidence.outbox_item(row) for row in await self._read(evidence.undelivered_sql("outbox"), ())]

    async def receipts(self, since: float | None = None) -> list[dict[str, Any]]:
        sql = evidence.SQLITE_RECEIPTS.format(where=" WHERE at >= ?" if since is not None else "")
        rows = await self._read(sql, (at_text(since),) if since is not None else ())
        return [evidence.sqlite_receipt(row) for row in rows]

    async def stored_digests(self) -> dict[str, tuple[str | None, str | None]]:
        rows = await self._read("SELECT operation_id, arguments, result FROM operations", ())
        return {row[0]: (digest(row[1]), digest(row[2])) for row in rows}

    @property
    def unsynced_outcomes(self) -> int:
        """Outcomes committed without a sync and not yet synced (durability "claim"; else 0)."""
        return self._writer.unsynced

    @property
    def group_commit_stats(self) -> tuple[int, int]:
        """(batches, writes) committed so far: writes / batches is the mean group size."""
        return self._writer.batches, self._writer.writes

    async def close(self) -> None:
        if self._writer_or_none is not None:
            self._writer_or_none.stop()
            await asyncio.to_thread(self._writer_or_none.join)
        await self._reader.close()
