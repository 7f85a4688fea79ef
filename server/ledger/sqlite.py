"""SQLite ledger: WAL, synchronous=FULL, one writer thread with group commit.

Every ledger step is one function run on a dedicated writer thread, so a claim
or an outcome costs one thread hop, not one per statement. The writer drains
whatever steps are queued and commits them in one transaction (group commit):
under concurrency many steps share one fsync. Consecutive claims of new keys,
and consecutive plain outcomes, run as one statement per table for the whole
run (`run_many`), falling back to one by one whenever a step needs its own
decision. A failing step never takes the others of its batch down: the batch
then runs again with each step in a savepoint. An operation alone in its
process runs its steps on the caller's thread, on a second connection that
never waits (`run_inline`); a replay is answered by one read on that same
connection while the writer is idle. Reads that need no write (status,
listings) go through an aiosqlite connection, which WAL lets run beside the
writer, and a checkpointer thread copies the WAL back off the commit path.

Several processes may share one file: BEGIN IMMEDIATE serialises writers
across processes, and the unique (principal, session, step) index makes the
claim exactly-once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import queue
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from ..model import IdempotencyClass, Operation, State, ToolResult
from .base import (
    LEASE_LOST,
    AuditEntry,
    Change,
    Claim,
    ClaimKind,
    ClaimRequest,
    Lease,
    LedgerUnavailable,
    OperationFilter,
    lease_over,
)

T = TypeVar("T")

MIGRATIONS: list[str] = [
    # 1: operations + audit trail
    """
    CREATE TABLE operations (
        operation_id     TEXT PRIMARY KEY,
        principal        TEXT NOT NULL,
        session          TEXT NOT NULL,
        step             TEXT NOT NULL,
        tool             TEXT NOT NULL,
        idempotency_class TEXT NOT NULL,
        fingerprint      TEXT NOT NULL,
        state            TEXT NOT NULL,
        attempts         INTEGER NOT NULL,
        fence            INTEGER NOT NULL,
        arguments        TEXT NOT NULL,
        lease_owner      TEXT,
        lease_expires_at REAL,
        result           TEXT,
        error            TEXT,
        reconciliation   TEXT,
        downstream_ref   TEXT,
        retention        REAL NOT NULL,
        created_at       REAL NOT NULL,
        updated_at       REAL NOT NULL,
        completed_at     REAL,
        expires_at       REAL
    );
    CREATE UNIQUE INDEX operations_key ON operations (principal, session, step);
    CREATE INDEX operations_state ON operations (state, lease_expires_at);
    CREATE INDEX operations_expiry ON operations (expires_at) WHERE expires_at IS NOT NULL;
    CREATE INDEX operations_recent ON operations (principal, created_at);
    CREATE TABLE audit (
        id           INTEGER PRIMARY KEY,
        operation_id TEXT NOT NULL,
        at           REAL NOT NULL,
        event        TEXT NOT NULL,
        from_state   TEXT,
        to_state     TEXT,
        fence        INTEGER NOT NULL,
        actor        TEXT,
        detail       TEXT
    );
    CREATE INDEX audit_operation ON audit (operation_id, id);
    """,
]

_COLUMNS = (
    "operation_id, principal, session, step, tool, idempotency_class, fingerprint, state, attempts, fence, "
    "arguments, lease_owner, lease_expires_at, result, error, reconciliation, downstream_ref, created_at, "
    "updated_at, completed_at, expires_at, retention"
)
_SELECT = f"SELECT {_COLUMNS} FROM operations"
_INSERT = (
    "INSERT INTO operations (operation_id, principal, session, step, tool, idempotency_class, fingerprint,"
    " state, attempts, fence, arguments, lease_owner, lease_expires_at, retention, created_at, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, 'RUNNING', 1, 1, ?, ?, ?, ?, ?, ?)"
)
_AUDIT = (
    "INSERT INTO audit (operation_id, at, event, from_state, to_state, fence, actor, detail)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


def _decode(row: Sequence[Any]) -> Operation:
    return Operation(
        operation_id=row[0],
        principal=row[1],
        session=row[2],
        step=row[3],
        tool=row[4],
        idempotency_class=IdempotencyClass(row[5]),
        fingerprint=row[6],
        state=State(row[7]),
        attempts=row[8],
        fence=row[9],
        arguments=json.loads(row[10]),
        lease_owner=row[11],
        lease_expires_at=row[12],
        result=ToolResult.from_json(row[13]) if row[13] else None,
        error=json.loads(row[14]) if row[14] else None,
        reconciliation=json.loads(row[15]) if row[15] else None,
        downstream_ref=row[16],
        created_at=row[17],
        updated_at=row[18],
        completed_at=row[19],
        expires_at=row[20],
        retention=row[21],
    )


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), default=str)


def path_from_url(url: str) -> Path:
    """`sqlite:///relative.db` and `sqlite:////absolute.db` (the SQLAlchemy convention)."""
    if not url.startswith("sqlite:///"):
        raise ValueError(
            f"not a sqlite URL: {url!r} (expected sqlite:///relative.db or sqlite:////abs/path.db)"
        )
    return Path(url[len("sqlite:///") :])


def _create_private(path: Path) -> None:
    """The ledger holds arguments and results: owner-only, from the first byte."""
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)


def _enable_wal(conn: sqlite3.Connection, busy_timeout_ms: int) -> None:
    """Switch a file to WAL. Processes opening a new file at once race here, and SQLite reports
    "database is locked" at once instead of applying busy_timeout: retry briefly."""
    deadline = time.monotonic() + busy_timeout_ms / 1000
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(random.uniform(0.002, 0.02))


class _Writer(threading.Thread):
    """Runs ledger steps on one connection, committing everything queued in one transaction."""

    _STOP = object()

    def __init__(self, path: Path, synchronous: str, busy_timeout_ms: int) -> None:
        super().__init__(name="commitgate-ledger-writer", daemon=True)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        _enable_wal(self._conn, busy_timeout_ms)
        self._conn.execute(f"PRAGMA synchronous = {synchronous}")
        # Inline steps get a connection of their own that never waits for a lock: a busy file sends
        # the step to this thread, which waits. (Toggling busy_timeout on one shared connection cost
        # two statements per step.)
        self._inline = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=0)
        self._inline.execute(f"PRAGMA synchronous = {synchronous}")
        for conn in (self._conn, self._inline):  # checkpoints belong to _Checkpointer; this is a backstop
            conn.execute(f"PRAGMA wal_autocheckpoint = {_BACKSTOP_CHECKPOINT_PAGES}")
        self._lock = threading.Lock()  # one write in flight in this process: a batch or an inline step
        self._checkpointer = _Checkpointer(path, synchronous, self._lock)
        self.batches = 0
        self._in_batch = False
        self.steps = 0

    def submit(self, step: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if not self.is_alive():  # closed (or crashed): nobody would ever answer
            future.set_exception(LedgerUnavailable("the ledger is closed"))
            return future
        self._queue.put((step, future, loop))
        return future

    def run_inline(self, step: Callable[[sqlite3.Connection], T]) -> tuple[bool, T | None]:
        """Run `step` on the caller's thread while the writer is idle: no thread hop at all.

        Two thread wake-ups per hop cost more than the SQL itself on small machines. Only an
        idle writer is bypassed, and only a write lock that is free right now is taken: a
        database locked by another process sends the step to the writer thread, which waits.
        Returns (False, None) when the step was not run.
        """
        if self._in_batch or not self._queue.empty() or not self._lock.acquire(blocking=False):
            return False, None
        conn = self._inline
        try:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:
                return False, None  # locked by another process: let the writer wait for it
            try:
                value = step(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return True, value
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"ledger write failed: {exc}") from exc
        finally:
            self._lock.release()

    def read_inline(self, sql: str, params: Sequence[Any]) -> Any:
        """One row, read on the inline connection from the caller's thread, outside any transaction.

        Sharing the inline steps' connection (and so their page cache) matters more than the read
        itself: between the requests of a real server the CPU caches are cold, and a second
        connection's pages cost a claim about 50 µs more (measured with caches flushed per call).
        """
        return self._inline.execute(sql, params).fetchone()

    @property
    def busy(self) -> bool:
        """A batch is being committed or steps are waiting for the next one."""
        return self._in_batch or not self._queue.empty()

    def start(self) -> None:
        super().start()
        self._checkpointer.start()

    def stop(self) -> None:
        self._queue.put(self._STOP)

    def run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if any(item is self._STOP for item in batch):
                stopping = True
                batch = [item for item in batch if item is not self._STOP]
            if batch:
                self._in_batch = True
                with self._lock:
                    self._run_batch(batch)
                self._in_batch = False
        with self._lock:
            self._inline.close()
        self._conn.close()
        self._checkpointer.stop()
        self._checkpointer.join(timeout=10)

    def _run_batch(self, batch: list[tuple[Callable[[sqlite3.Connection], Any], Any, Any]]) -> None:
        steps = [step for step, _, _ in batch]
        try:
            # Optimistically without a savepoint per step (two statements fewer each); if a step
            # fails, nothing is kept and the batch runs again with each step isolated. Steps only
            # read and write through `conn`, so running one again is safe.
            outcomes = self._together(steps)
            if outcomes is None:
                outcomes = self._isolated(steps)
        except sqlite3.Error as exc:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            failure = LedgerUnavailable(f"ledger write failed: {exc}")
            outcomes = [(False, failure)] * len(batch)
        self.batches += 1
        self.steps += len(batch)
        # One wake-up per event loop and batch, not one per step: each costs a self-pipe write.
        settled: dict[Any, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
        for (_, future, loop), (ok, value) in zip(batch, outcomes, strict=True):
            settled.setdefault(loop, []).append((future, ok, value))
        for loop, items in settled.items():
            loop.call_soon_threadsafe(_settle_all, items)

    def _together(self, steps: list[Callable[[sqlite3.Connection], Any]]) -> list[tuple[bool, Any]] | None:
        """All steps in one transaction; None (everything rolled back) as soon as one fails."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            outcomes = [(True, value) for value in _run_steps(conn, steps)]
        except Exception:
            conn.execute("ROLLBACK")
            return None
        conn.execute("COMMIT")
        return outcomes

    def _isolated(self, steps: list[Callable[[sqlite3.Connection], Any]]) -> list[tuple[bool, Any]]:
        """All steps in one transaction, each in a savepoint: a failing step takes only itself down."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        outcomes: list[tuple[bool, Any]] = []
        for step in steps:
            conn.execute("SAVEPOINT step")
            try:
                outcomes.append((True, step(conn)))
            except Exception as exc:
                conn.execute("ROLLBACK TO step")
                outcomes.append((False, exc))
            conn.execute("RELEASE step")
        conn.execute("COMMIT")
        return outcomes


_BACKSTOP_CHECKPOINT_PAGES = 20_000  # ~80 MB of WAL: reached only if the checkpointer falls behind


class _Checkpointer(threading.Thread):
    """Copies the WAL back into the database file off the commit path.

    SQLite's own checkpoint runs inside whichever commit crosses 1,000 WAL pages, so about one
    group commit in thirty waited milliseconds for it: that was the p99 of the ledger. A passive
    checkpoint from a connection of its own never blocks writers (it copies what readers allow
    and leaves the rest for next time); the writers keep a far larger automatic threshold only
    as a backstop. Several processes on one file each run one; SQLite lets one at a time work.
    """

    def __init__(self, path: Path, synchronous: str, write_lock: threading.Lock, every: float = 0.25) -> None:
        super().__init__(name="commitgate-ledger-checkpoint", daemon=True)
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=0)
        self._conn.execute(f"PRAGMA synchronous = {synchronous}")
        self._write_lock = write_lock
        self._every = every
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self._stopping.wait(self._every):
                self.checkpoint()
        finally:
            self._conn.close()

    def checkpoint(self) -> None:
        with contextlib.suppress(sqlite3.Error):  # another process's checkpointer is at work: next time
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()  # the bulk, beside the writers
            with self._write_lock:  # what they committed meanwhile: usually a few frames
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def stop(self) -> None:
        self._stopping.set()


def _settle_all(items: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for future, ok, value in items:
        _settle(future, ok, value)


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # the caller was cancelled; the step still happened
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _audit(
    conn: sqlite3.Connection,
    operation_id: str,
    now: float,
    event: str,
    from_state: str | None,
    to_state: str | None,
    fence: int,
    actor: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    conn.execute(_AUDIT, (operation_id, now, event, from_state, to_state, fence, actor, _dump(detail)))


def _to_unknown(conn: sqlite3.Connection, op: Operation, now: float) -> None:
    conn.execute(
        "UPDATE operations SET state = 'UNKNOWN', lease_owner = NULL, lease_expires_at = NULL, updated_at = ?,"
        " error = ? WHERE operation_id = ? AND fence = ? AND state = 'RUNNING'",
        (now, _dump(LEASE_LOST), op.operation_id, op.fence),
    )
    _audit(conn, op.operation_id, now, "lease_expired", "RUNNING", "UNKNOWN", op.fence, detail=None)
    op.state, op.lease_owner, op.lease_expires_at, op.updated_at = State.UNKNOWN, None, None, now
    op.error = dict(LEASE_LOST)


# States a claim can be answered from without writing anything (see `SQLiteLedger._settled`).
_SETTLED = frozenset({State.SUCCEEDED.value, State.FAILED_FINAL.value, State.COMPENSATED.value})


class _ClaimStep:
    """Claim one key. In a group commit, consecutive claims of new keys run as one statement each
    for the rows and their audit entries (`run_many`); anything unusual runs step by step."""

    __slots__ = ("now", "request")

    def __init__(self, request: ClaimRequest, now: float) -> None:
        self.request, self.now = request, now

    def __call__(self, conn: sqlite3.Connection) -> Claim:
        return _claim(conn, self.request, self.now)

    @staticmethod
    def run_many(conn: sqlite3.Connection, steps: Sequence[_ClaimStep]) -> list[Claim] | None:
        """All new, distinct keys: claimed together. Otherwise (a key taken, past retention, or
        repeated in the batch) nothing of it is kept and None says: run them one by one."""
        if len({(s.request.principal, s.request.session, s.request.step) for s in steps}) != len(steps):
            return None
        ops = [_new_operation(s.request, s.now) for s in steps]
        with _savepoint(conn) as undo:
            inserted = conn.executemany(
                _INSERT + " ON CONFLICT (principal, session, step) DO NOTHING",
                [_insert_row(op, s.request) for op, s in zip(ops, steps, strict=True)],
            ).rowcount
            if inserted != len(steps):
                undo()
                return None
            conn.executemany(_AUDIT, [_claimed_row(op) for op in ops])
        return [Claim(ClaimKind.NEW, op) for op in ops]


class _ApplyStep:
    """Apply one change (`_apply`). In a group commit, consecutive plain outcomes (RUNNING to a
    final state, fenced, no lease) are written with one update, one audit insert and one read."""

    __slots__ = ("change", "current", "now", "operation_id")

    def __init__(
        self, operation_id: str, change: Change, now: float, current: Operation | None = None
    ) -> None:
        self.operation_id, self.change, self.now = operation_id, change, now
        # The operation as the caller holds it at the change's fence: a plain outcome then needs no read.
        known = current is not None and current.fence == change.expect_fence and self.plain_outcome
        self.current = current if known else None

    def __call__(self, conn: sqlite3.Connection) -> Operation | None:
        if self.current is not None:
            return _apply_known(conn, self.current, self.change, self.now)
        return _apply(conn, self.operation_id, self.change, self.now)

    @property
    def plain_outcome(self) -> bool:
        change = self.change
        return (
            change.expect_states == _RUNNING_ONLY
            and change.expect_fence is not None
            and change.lease is None
            and change.to_state.terminal
            and change.reconciliation is None
            and (change.error is not None or change.to_state is State.SUCCEEDED)
        )

    @staticmethod
    def run_many(conn: sqlite3.Connection, steps: Sequence[_ApplyStep]) -> list[Operation | None] | None:
        """What `_apply` would do to each, if every one applies; otherwise None and nothing kept."""
        ids = [s.operation_id for s in steps]
        if len(set(ids)) != len(ids) or not all(s.plain_outcome for s in steps):
            return None
        with _savepoint(conn) as undo:
            updated = conn.executemany(
                "UPDATE operations SET state = ?, result = COALESCE(?, result), error = ?, lease_owner = NULL,"
                " lease_expires_at = NULL, updated_at = ?, completed_at = ?, expires_at = ? + retention"
                " WHERE operation_id = ? AND fence = ? AND state = 'RUNNING'",
                [
                    (
                        s.change.to_state.value,
                        s.change.result.to_json() if s.change.result is not None else None,
                        _dump(s.change.error),
                        s.now,
                        s.now,
                        s.now,
                        s.operation_id,
                        s.change.expect_fence,
                    )
                    for s in steps
                ],
            ).rowcount
            if updated != len(steps):  # one was fenced out or moved on: decide each on its own
                undo()
                return None
            conn.executemany(
                _AUDIT,
                [
                    (s.operation_id, s.now, s.change.event, "RUNNING", s.change.to_state.value,
                     s.change.expect_fence, s.change.actor, _dump(s.change.detail))
                    for s in steps
                ],
            )  # fmt: skip
            if all(s.current is not None for s in steps):
                return [_outcome(s.current, s.change, s.now) for s in steps if s.current is not None]
            marks = ",".join("?" * len(ids))
            rows = {row[0]: row for row in conn.execute(f"{_SELECT} WHERE operation_id IN ({marks})", ids)}
        return [_decode(rows[operation_id]) for operation_id in ids]


_RUNNING_ONLY = frozenset({State.RUNNING})


@contextlib.contextmanager
def _savepoint(conn: sqlite3.Connection) -> Iterator[Callable[[], None]]:
    """A savepoint around a batched write; the body calls `undo()` to drop what it wrote."""

    def undo() -> None:
        conn.execute("ROLLBACK TO batched")

    conn.execute("SAVEPOINT batched")
    try:
        yield undo
    finally:
        conn.execute("RELEASE batched")


def _run_steps(conn: sqlite3.Connection, steps: Sequence[Callable[[sqlite3.Connection], Any]]) -> list[Any]:
    """Each step's value, in order; runs of two or more steps of a kind with `run_many` go together."""
    values: list[Any] = []
    i = 0
    while i < len(steps):
        kind = type(steps[i])
        j = i + 1
        while j < len(steps) and type(steps[j]) is kind:
            j += 1
        run = steps[i:j]
        run_many = getattr(kind, "run_many", None)
        together = run_many(conn, run) if run_many is not None and len(run) > 1 else None
        values += together if together is not None else [step(conn) for step in run]
        i = j
    return values


def _claim(conn: sqlite3.Connection, request: ClaimRequest, now: float) -> Claim:
    row = conn.execute(
        f"{_SELECT} WHERE principal = ? AND session = ? AND step = ?",
        (request.principal, request.session, request.step),
    ).fetchone()
    if row is not None and row[20] is not None and row[20] <= now:  # past retention: gone
        conn.execute("DELETE FROM audit WHERE operation_id = ?", (row[0],))
        conn.execute("DELETE FROM operations WHERE operation_id = ?", (row[0],))
        row = None
    if row is None:
        return Claim(ClaimKind.NEW, _insert(conn, request, now))
    op = _decode(row)
    if op.tool != request.tool or op.fingerprint != request.fingerprint:
        return Claim(ClaimKind.CONFLICT, op)
    if lease_over(op, now):
        _to_unknown(conn, op, now)
    if op.state is State.FAILED_RETRYABLE:  # certainly not applied: this caller runs it again
        lease = Lease(request.owner, now + request.lease_seconds)
        taken = _apply(conn, op.operation_id, _retake(lease), now)
        if taken is not None:
            return Claim(ClaimKind.NEW, taken)
    return Claim(ClaimKind.EXISTING, op)


def _retake(lease: Lease) -> Change:
    return Change(
        to_state=State.RUNNING,
        expect_states=frozenset({State.FAILED_RETRYABLE}),
        event="retry_claimed",
        lease=lease,
    )


def _new_operation_id() -> str:
    """`op_` + 32 hex digits like a UUID, but time-ordered (microseconds, then 72 random bits).

    New ids land at the right edge of the primary-key and audit indexes instead of on a
    random page each, so a group commit writes (and fsyncs) far fewer pages.
    """
    return f"op_{time.time_ns() // 1000:014x}{os.urandom(9).hex()}"


def _new_operation(request: ClaimRequest, now: float) -> Operation:
    """The RUNNING operation a claim of a new key creates (not yet written)."""
    return Operation(
        operation_id=_new_operation_id(),
        principal=request.principal,
        session=request.session,
        step=request.step,
        tool=request.tool,
        idempotency_class=request.idempotency_class,
        fingerprint=request.fingerprint,
        state=State.RUNNING,
        attempts=1,
        fence=1,
        arguments=json.loads(request.arguments_json),
        created_at=now,
        updated_at=now,
        lease_owner=request.owner,
        lease_expires_at=now + request.lease_seconds,
        retention=request.retention_seconds,
    )


def _insert_row(op: Operation, request: ClaimRequest) -> tuple[Any, ...]:
    return (
        op.operation_id,
        op.principal,
        op.session,
        op.step,
        op.tool,
        op.idempotency_class.value,
        op.fingerprint,
        request.arguments_json,
        op.lease_owner,
        op.lease_expires_at,
        op.retention,
        op.created_at,
        op.updated_at,
    )


def _claimed_row(op: Operation) -> tuple[Any, ...]:
    return (op.operation_id, op.created_at, "claimed", None, "RUNNING", 1, op.lease_owner, None)


def _insert(conn: sqlite3.Connection, request: ClaimRequest, now: float) -> Operation:
    op = _new_operation(request, now)
    conn.execute(_INSERT, _insert_row(op, request))
    conn.execute(_AUDIT, _claimed_row(op))
    return op


def _apply(conn: sqlite3.Connection, operation_id: str, change: Change, now: float) -> Operation | None:
    row = conn.execute(f"{_SELECT} WHERE operation_id = ?", (operation_id,)).fetchone()
    if row is None:
        return None
    op = _decode(row)
    if op.state not in change.expect_states:
        return None
    if change.expect_fence is not None and op.fence != change.expect_fence:
        return None
    from_state = _transition(op, change, now)
    conn.execute(
        "UPDATE operations SET state = ?, attempts = ?, fence = ?, lease_owner = ?, lease_expires_at = ?,"
        " result = ?, error = ?, reconciliation = ?, updated_at = ?, completed_at = ?, expires_at = ?"
        " WHERE operation_id = ?",
        (
            op.state.value,
            op.attempts,
            op.fence,
            op.lease_owner,
            op.lease_expires_at,
            op.result.to_json() if op.result is not None else None,
            _dump(op.error),
            _dump(op.reconciliation),
            now,
            op.completed_at,
            op.expires_at,
            operation_id,
        ),
    )
    _audit(
        conn,
        operation_id,
        now,
        change.event,
        from_state.value,
        op.state.value,
        op.fence,
        change.actor,
        change.detail,
    )
    return op


def _apply_known(
    conn: sqlite3.Connection, current: Operation, change: Change, now: float
) -> Operation | None:
    """A plain outcome of an operation the caller holds at its fence: written without reading it.

    The fence and RUNNING in the WHERE clause are exactly `_apply`'s checks for such a change;
    whatever else may have moved meanwhile (a lease renewal) the outcome overwrites anyway.
    """
    op = _outcome(current, change, now)
    cursor = conn.execute(
        "UPDATE operations SET state = ?, result = ?, error = ?, lease_owner = NULL, lease_expires_at = NULL,"
        " updated_at = ?, completed_at = ?, expires_at = ? WHERE operation_id = ? AND fence = ? AND state = 'RUNNING'",
        (
            op.state.value,
            op.result.to_json() if op.result is not None else None,
            _dump(op.error),
            now,
            op.completed_at,
            op.expires_at,
            op.operation_id,
            op.fence,
        ),
    )
    if cursor.rowcount != 1:
        return None
    _audit(
        conn,
        op.operation_id,
        now,
        change.event,
        "RUNNING",
        op.state.value,
        op.fence,
        change.actor,
        change.detail,
    )
    return op


def _outcome(current: Operation, change: Change, now: float) -> Operation:
    """`current` after a plain outcome, as a new object (the caller keeps its own)."""
    op = dataclasses.replace(current)
    _transition(op, change, now)
    return op


def _transition(op: Operation, change: Change, now: float) -> State:
    """Move `op` as `change` says (its expectations already checked); returns the state it left."""
    from_state = op.state
    op.state = change.to_state
    op.updated_at = now
    if change.result is not None:
        op.result = change.result
    if change.error is not None or change.to_state in (State.SUCCEEDED, State.RUNNING):
        op.error = change.error
    if change.reconciliation is not None:
        op.reconciliation = change.reconciliation
    if change.lease is not None:
        op.fence += 1
        op.attempts += 1
        op.lease_owner, op.lease_expires_at = change.lease.owner, change.lease.expires_at
    elif change.to_state is not State.RUNNING:
        op.lease_owner = op.lease_expires_at = None
    if change.to_state.terminal:
        op.completed_at = op.completed_at if from_state is State.SUCCEEDED else now
        op.expires_at = now + op.retention
    else:
        op.completed_at = op.expires_at = None
    return from_state


class SQLiteLedger:
    """A ledger in one SQLite file; see the module docstring for how writes are batched."""

    def __init__(self, path: Path, writer: _Writer, reader: aiosqlite.Connection) -> None:
        self.path = path
        self._writer = writer
        self._reader = reader
        self.inline_when_alone = True  # see `_write`
        self._open: set[str] = set()  # operations this process claimed and has not finished

    @classmethod
    async def open(
        cls, path: Path | str, *, synchronous: str = "FULL", busy_timeout_ms: int = 5000
    ) -> SQLiteLedger:
        path = Path(path).expanduser()
        if synchronous.upper() not in ("FULL", "NORMAL", "EXTRA", "OFF"):
            raise ValueError(f"synchronous must be FULL, NORMAL, EXTRA or OFF, not {synchronous!r}")
        try:
            _create_private(path)
            writer = _Writer(path, synchronous.upper(), busy_timeout_ms)
        except (OSError, sqlite3.Error) as exc:
            raise LedgerUnavailable(f"cannot open ledger {path}: {exc}") from exc
        writer.start()
        ledger = cls(path, writer, await aiosqlite.connect(path))
        try:
            await ledger._reader.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            await ledger._write(_migrate)
        except BaseException:  # e.g. a schema newer than this code: never leave threads behind
            await ledger.close()
            raise
        return ledger

    async def _write(self, step: Callable[[sqlite3.Connection], T], *, alone: bool = False) -> T:
        """One ledger step. `alone`: no other operation of this process is in flight, so there is no
        group to commit with; run it on this thread if the writer is idle (no thread hop). With
        company it goes to the writer, whose next batch commits it with the others."""
        if alone and self.inline_when_alone:
            ran, value = self._writer.run_inline(step)
            if ran:
                await asyncio.sleep(0)  # let other tasks in, so that company (and batching) can form
                return value  # type: ignore[return-value]  # ran => the step's own value
        return await self._writer.submit(step)

    async def claim(self, request: ClaimRequest, now: float) -> Claim:
        # A replay is answered by one read outside any transaction: cheaper than the write
        # transaction a claim step takes even inline. Under load the writer hop is shared with a whole batch anyway,
        # and a read beside a busy writer contends with it (WAL read locks, the GIL) while most
        # claims are of new keys and find nothing: then go straight to the writer.
        settled: Claim | None = None
        alone = not self._open and self.inline_when_alone
        if not self._writer.busy:
            settled = self._settled(request, now)
        claim: Claim = (
            settled if settled is not None else await self._write(_ClaimStep(request, now), alone=alone)
        )
        if claim.kind is ClaimKind.NEW:
            self._open.add(claim.operation.operation_id)
        return claim

    def _settled(self, request: ClaimRequest, now: float) -> Claim | None:
        """A replay or a conflict, answered from one indexed read without the writer thread.

        A settled operation changes only by compensation or purge, so a committed WAL snapshot
        answers it as the writer would (the read takes no lock and never waits for writers);
        anything else, or any error, takes the writer's path.
        """
        try:
            row = self._writer.read_inline(
                f"{_SELECT} WHERE principal = ? AND session = ? AND step = ?",
                (request.principal, request.session, request.step),
            )
        except sqlite3.Error:
            return None
        if row is None or (row[20] is not None and row[20] <= now):  # none, or past retention
            return None
        if row[4] != request.tool or row[6] != request.fingerprint:
            return Claim(ClaimKind.CONFLICT, _decode(row))
        if row[7] in _SETTLED:
            return Claim(ClaimKind.EXISTING, _decode(row))
        return None

    async def update(
        self, operation_id: str, change: Change, now: float, *, current: Operation | None = None
    ) -> Operation | None:
        alone = self._open <= {operation_id}
        updated = await self._write(_ApplyStep(operation_id, change, now, current), alone=alone)
        if updated is not None:
            if updated.state is State.RUNNING:
                self._open.add(operation_id)
            else:
                self._open.discard(operation_id)
        return updated

    async def renew_lease(self, operation_id: str, fence: int, lease: Lease) -> bool:
        def step(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE operations SET lease_owner = ?, lease_expires_at = ?"
                " WHERE operation_id = ? AND fence = ? AND state = 'RUNNING'",
                (lease.owner, lease.expires_at, operation_id, fence),
            )
            return cursor.rowcount == 1

        return await self._write(step)

    async def _read(self, sql: str, params: Sequence[Any]) -> list[Any]:
        try:
            return list(await self._reader.execute_fetchall(sql, params))
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"ledger read failed: {exc}") from exc

    async def get(self, principal: str, session: str, step: str) -> Operation | None:
        rows = await self._read(
            f"{_SELECT} WHERE principal = ? AND session = ? AND step = ?", (principal, session, step)
        )
        return _decode(rows[0]) if rows else None

    async def get_by_id(self, principal: str | None, operation_id: str) -> Operation | None:
        rows = await self._read(f"{_SELECT} WHERE operation_id = ?", (operation_id,))
        if not rows:
            return None
        op = _decode(rows[0])
        return op if principal is None or op.principal == principal else None

    async def find(self, where: OperationFilter) -> list[Operation]:
        clauses: list[str] = []
        params: list[Any] = []
        for column, value in (
            ("principal", where.principal),
            ("session", where.session),
            ("state", where.state.value if where.state else None),
            ("tool", where.tool),
        ):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if where.older_than is not None:
            clauses.append("updated_at <= ?")
            params.append(where.older_than)
        sql = _SELECT + (" WHERE " + " AND ".join(clauses) if clauses else "")
        sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        params.append(where.limit)
        return [_decode(row) for row in await self._read(sql, params)]

    async def history(self, operation_id: str) -> list[AuditEntry]:
        rows = await self._read(
            "SELECT at, event, from_state, to_state, fence, actor, detail FROM audit WHERE operation_id = ?"
            " ORDER BY id",
            (operation_id,),
        )
        return [
            AuditEntry(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]) if r[6] else None) for r in rows
        ]

    async def expire_leases(self, now: float) -> list[Operation]:
        def step(conn: sqlite3.Connection) -> list[Operation]:
            rows = conn.execute(f"{_SELECT} WHERE state = 'RUNNING'").fetchall()
            expired = [op for op in map(_decode, rows) if lease_over(op, now)]
            for op in expired:
                _to_unknown(conn, op, now)
            return expired

        return await self._write(step)

    async def purge(self, now: float) -> int:
        def step(conn: sqlite3.Connection) -> int:
            doomed = "SELECT operation_id FROM operations WHERE expires_at IS NOT NULL AND expires_at <= ?"
            conn.execute(f"DELETE FROM audit WHERE operation_id IN ({doomed})", (now,))
            return conn.execute(
                "DELETE FROM operations WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            ).rowcount

        return await self._write(step)

    async def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in State}
        for state, n in await self._read("SELECT state, count(*) FROM operations GROUP BY state", ()):
            counts[state] = n
        for event, n in await self._read("SELECT event, count(*) FROM audit GROUP BY event", ()):
            counts[f"event:{event}"] = n
        return counts

    async def check_writable(self) -> None:
        await self._write(lambda conn: conn.execute("CREATE TEMP TABLE IF NOT EXISTS _probe (x)"))

    @property
    def group_commit_stats(self) -> tuple[int, int]:
        """(batches, steps) committed so far: steps / batches is the mean group size."""
        return self._writer.batches, self._writer.steps

    async def close(self) -> None:
        self._writer.stop()
        await asyncio.to_thread(self._writer.join)
        await self._reader.close()


def _migrate(conn: sqlite3.Connection) -> int:
    """Apply pending migrations inside the writer's transaction (safe with several processes)."""
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    current = row[0] or 0
    if current > len(MIGRATIONS):
        raise LedgerUnavailable(
            f"ledger schema version {current} is newer than this commitgate ({len(MIGRATIONS)}); upgrade commitgate"
        )
    for version in range(current + 1, len(MIGRATIONS) + 1):
        for statement in MIGRATIONS[version - 1].split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    return len(MIGRATIONS)
