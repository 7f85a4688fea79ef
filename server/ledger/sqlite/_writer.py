"""The threads of the SQLite ledger: the writer (group commit) and the checkpointer."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from commitgate.server.ledger.base import LedgerUnavailable
from commitgate.server.ledger.evidence import Evidence, seal_sqlite, watch_sqlite
from commitgate.server.ledger.sqlite._writes import run_writes
from commitgate.server.ledger.threads import name_os_thread

T = TypeVar("T")
# A queued write: the write, the future that answers it, and that future's event loop.
_Queued = tuple[Callable[[sqlite3.Connection], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop]

log = logging.getLogger("commitgate.ledger")

_BACKSTOP_CHECKPOINT_PAGES = 20_000  # ~80 MB of WAL: reached only if the checkpointer falls behind


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


class Writer(threading.Thread):
    """Runs ledger writes on one connection, committing everything queued in one transaction.

    `lazy_within` (durability "claim"): a transaction made only of writes marked `lazy` (outcomes)
    commits with synchronous=NORMAL: in the WAL, without a sync. The next synced commit syncs the
    whole WAL, and so them too; `_Syncer` syncs the WAL itself when none came within `lazy_within`
    seconds. Claims always commit with the configured synchronous setting.
    """

    _STOP = object()

    def __init__(
        self, path: Path, synchronous: str, busy_timeout_ms: int, lazy_within: float | None = None
    ) -> None:
        super().__init__(name="commitgate-ledger-writer", daemon=True)
        self._synchronous = synchronous
        # Only a sync that would happen can be saved: NORMAL and OFF never sync a commit anyway.
        self.lazy_outcomes = lazy_within is not None and synchronous in ("FULL", "EXTRA")
        self._modes: dict[sqlite3.Connection, bool] = {}  # connection -> its commits are lazy
        self._syncer = _Syncer(path, lazy_within or 0.05)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Batched statements differ by their row count (`rows_statement`): room for all of them.
        self._conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, cached_statements=512
        )
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        _enable_wal(self._conn, busy_timeout_ms)
        self._conn.execute(f"PRAGMA synchronous = {synchronous}")
        # Inline writes get a connection of their own that never waits for a lock: a busy file sends
        # the write to this thread, which waits. (Toggling busy_timeout on one shared connection cost
        # two statements per write.)
        self._inline = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=0)
        self._inline.execute(f"PRAGMA synchronous = {synchronous}")
        for conn in (self._conn, self._inline):  # checkpoints belong to _Checkpointer; this is a backstop
            conn.execute(f"PRAGMA wal_autocheckpoint = {_BACKSTOP_CHECKPOINT_PAGES}")
            # What a statement may have to undo goes to a statement journal; past 64 KiB (a group
            # commit's pages) SQLite spilled it to a new temporary file, one per batch.
            conn.execute("PRAGMA temp_store = MEMORY")
        self._lock = threading.Lock()  # one write in flight in this process: a batch or an inline write
        self.commits = 0  # transactions committed (batches and inline writes): what grew the WAL
        self._checkpointer = _Checkpointer(path, synchronous, self._lock, lambda: self.commits)
        self.batches = 0
        self._in_batch = False
        self.writes = 0
        # Run before a batch holding writes marked `needs_precheck`; raising LedgerUnavailable fails
        # exactly those writes. (The ledger's check that its file is still the one at its path.)
        self.precheck: Callable[[], None] | None = None
        # Whether a write submitted now will be answered: set while the run loop takes writes. (A
        # flag, not `is_alive()`, which takes a lock on every submit.)
        self._accepting = False
        self._evidence: Evidence | None = None  # receipts and events added to every transaction
        self._due: dict[sqlite3.Connection, list[tuple[str, int]]] = {}
        # Each receipt chain's head as of this file's last commit, for both connections (`seal_sqlite`).
        self._heads: dict[str, tuple[int, str]] = {}

    def attach(self, evidence: Evidence) -> None:
        """From now on every transaction writes the receipts and events of its audit entries."""
        with self._lock:
            for conn in (self._conn, self._inline):
                self._due[conn] = []
                watch_sqlite(conn, self._due[conn])
            self._evidence = evidence

    def _seal(self, conn: sqlite3.Connection) -> tuple[str, tuple[int, str]] | None:
        """Receipts and events into the open transaction; the receipt chain's head it will leave."""
        if self._evidence is None:
            return None
        return seal_sqlite(conn, self._evidence, self._due[conn], self._heads)

    def submit(self, write: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if not self._accepting:  # closed (or crashed): nobody would ever answer
            future.set_exception(LedgerUnavailable("the ledger is closed"))
            return future
        self._queue.put((write, future, loop))
        return future

    def run_inline(self, write: Callable[[sqlite3.Connection], T]) -> tuple[bool, T | None]:
        """Run `write` on the caller's thread while the writer is idle: no thread hop at all.

        Two thread wake-ups per hop cost more than the SQL itself on small machines. Only an
        idle writer is bypassed, and only a write lock that is free right now is taken: a
        database locked by another process sends the write to the writer thread, which waits.
        Returns (False, None) when the write was not run.
        """
        if self._in_batch or not self._queue.empty() or not self._lock.acquire(blocking=False):
            return False, None
        conn = self._inline
        try:
            lazy, changes = self._set_mode(conn, [write]), conn.total_changes
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:
                return False, None  # locked by another process: let the writer wait for it
            try:
                value = write(conn)
                head = self._seal(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            self._committed(lazy, changes, conn, head)
            return True, value
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"ledger write failed: {exc}") from exc
        finally:
            self._lock.release()

    def read_inline(self, sql: str, params: Sequence[Any]) -> Any:
        """One row, read on the inline connection from the caller's thread, outside any transaction.

        Sharing the inline writes' connection (and so their page cache) matters more than the read
        itself: between the requests of a real server the CPU caches are cold, and a second
        connection's pages cost a claim about 50 µs more (measured with caches flushed per call).
        """
        return self._inline.execute(sql, params).fetchone()

    def _set_mode(self, conn: sqlite3.Connection, writes: Sequence[Any]) -> bool:
        """Before a transaction: commit it without a sync when every write in it may wait for one.
        The setting is per connection and changed only when it differs (a statement each way)."""
        lazy = self.lazy_outcomes and all(getattr(write, "lazy", False) for write in writes)
        if self._modes.get(conn, False) is not lazy:
            conn.execute(f"PRAGMA synchronous = {'NORMAL' if lazy else self._synchronous}")
            self._modes[conn] = lazy
        return lazy

    def _committed(
        self,
        lazy: bool,
        changes_before: int,
        conn: sqlite3.Connection,
        head: tuple[str, tuple[int, str]] | None = None,
    ) -> None:
        """After a commit, under the write lock: the receipt chain's new head is the file's now; a
        synced commit synced every earlier one too (if it wrote anything: a commit without changes
        writes no WAL frame and syncs nothing)."""
        self.commits += 1
        if head is not None:
            self._heads[head[0]] = head[1]
        if lazy:
            self._syncer.owe()
        elif self.lazy_outcomes and conn.total_changes != changes_before:
            self._syncer.paid()

    @property
    def unsynced(self) -> int:
        """Lazy commits not yet synced."""
        return self._syncer.owed

    @property
    def busy(self) -> bool:
        """A batch is being committed or writes are waiting for the next one."""
        return self._in_batch or not self._queue.empty()

    def start(self) -> None:
        self._accepting = True
        super().start()
        self._checkpointer.start()
        if self.lazy_outcomes:
            self._syncer.start()

    def stop(self) -> None:
        self._accepting = False  # a write submitted after the stop would never be answered
        self._queue.put(self._STOP)

    def run(self) -> None:
        name_os_thread()
        try:
            self._take_writes()
        finally:
            self._accepting = False
        if self._syncer.is_alive():  # its last sync while the WAL is surely there
            self._syncer.stop()
            self._syncer.join(timeout=10)
        with self._lock:
            self._inline.close()
        self._conn.close()
        self._checkpointer.stop()
        self._checkpointer.join(timeout=10)

    def _take_writes(self) -> None:
        """Commit what is queued, batch after batch, until told to stop."""
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

    def _run_batch(self, batch: list[_Queued]) -> None:
        batch = self._prechecked(batch)
        if not batch:
            return
        writes = [write for write, _, _ in batch]
        try:
            # Optimistically without a savepoint per write (two statements fewer each); if a write
            # fails, nothing is kept and the batch runs again with each write isolated. Writes only
            # read and write through `conn`, so running one again is safe.
            outcomes = self._together(writes)
            if outcomes is None:
                outcomes = self._isolated(writes)
        except sqlite3.Error as exc:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            failure = LedgerUnavailable(f"ledger write failed: {exc}")
            outcomes = [(False, failure)] * len(batch)
        self.batches += 1
        self.writes += len(batch)
        _answer(batch, outcomes)

    def _prechecked(self, batch: list[_Queued]) -> list[_Queued]:
        """The batch without the writes its precheck refuses (those are answered here)."""
        if self.precheck is None or not any(getattr(write, "needs_precheck", False) for write, _, _ in batch):
            return batch
        try:
            self.precheck()
        except LedgerUnavailable as exc:
            kept: list[_Queued] = []
            refused: list[_Queued] = []
            for item in batch:
                (refused if getattr(item[0], "needs_precheck", False) else kept).append(item)
            _answer(refused, [(False, exc)] * len(refused))
            return kept
        return batch

    def _together(self, writes: list[Callable[[sqlite3.Connection], Any]]) -> list[tuple[bool, Any]] | None:
        """All writes in one transaction; None (everything rolled back) as soon as one fails."""
        conn = self._conn
        lazy, changes = self._set_mode(conn, writes), conn.total_changes
        conn.execute("BEGIN IMMEDIATE")
        try:
            outcomes = [(True, value) for value in run_writes(conn, writes)]
            head = self._seal(conn)
        except Exception:
            conn.execute("ROLLBACK")
            return None
        conn.execute("COMMIT")
        self._committed(lazy, changes, conn, head)
        return outcomes

    def _isolated(self, writes: list[Callable[[sqlite3.Connection], Any]]) -> list[tuple[bool, Any]]:
        """All writes in one transaction, each in a savepoint: a failing write takes only itself down."""
        conn = self._conn
        lazy, changes = self._set_mode(conn, writes), conn.total_changes
        conn.execute("BEGIN IMMEDIATE")
        outcomes: list[tuple[bool, Any]] = []
        for write in writes:
            conn.execute("SAVEPOINT step")
            try:
                outcomes.append((True, write(conn)))
            except Exception as exc:
                conn.execute("ROLLBACK TO step")
                outcomes.append((False, _as_ledger_failure(exc)))
            conn.execute("RELEASE step")
        head = self._seal(conn)
        conn.execute("COMMIT")
        self._committed(lazy, changes, conn, head)
        return outcomes


class _Checkpointer(threading.Thread):
    """Copies the WAL back into the database file off the commit path.

    SQLite's own checkpoint runs inside whichever commit crosses 1,000 WAL pages, so about one
    group commit in thirty waited milliseconds for it: that was the p99 of the ledger. A passive
    checkpoint from a connection of its own never blocks writers (it copies what readers allow
    and leaves the rest for next time); the writers keep a far larger automatic threshold only
    as a backstop. Several processes on one file each run one; SQLite lets one at a time work.
    It works only when this process committed since its last complete checkpoint (`commits`, a
    count): an idle server leaves the write lock alone.
    """

    def __init__(
        self,
        path: Path,
        synchronous: str,
        write_lock: threading.Lock,
        commits: Callable[[], int],
        every: float = 0.25,
    ) -> None:
        super().__init__(name="commitgate-ledger-checkpoint", daemon=True)
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=0)
        self._conn.execute(f"PRAGMA synchronous = {synchronous}")
        self._write_lock = write_lock
        self._commits = commits
        self._done_through: int | None = None  # the commit count its last complete checkpoint covered
        self._every = every
        self._stopping = threading.Event()

    def run(self) -> None:
        name_os_thread()
        try:
            while not self._stopping.wait(self._every):
                self.checkpoint()
        finally:
            self._conn.close()

    def checkpoint(self) -> None:
        commits = self._commits()
        if commits == self._done_through:
            return
        try:
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()  # the bulk, beside the writers
            with self._write_lock:  # what they committed meanwhile: usually a few frames
                commits = self._commits()
                busy, frames, copied = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error:  # another process's checkpointer is at work: next time
            return
        # A reader that held frames back leaves some to copy: then the next tick tries again.
        self._done_through = commits if busy == 0 and copied == frames else None

    def stop(self) -> None:
        self._stopping.set()


class _Syncer(threading.Thread):
    """Syncs the WAL at most `within` seconds after a commit that did not sync (durability "claim").

    A sync of the WAL file makes every frame written before it durable, whichever connection or
    commit wrote them, so one sync pays for all the outcomes committed meanwhile.
    """

    def __init__(self, path: Path, within: float) -> None:
        super().__init__(name="commitgate-ledger-sync", daemon=True)
        self._wal = Path(f"{path}-wal")
        self._within = within
        self._due = threading.Event()
        self._stopping = threading.Event()
        self._counts = threading.Lock()
        self._owed_through = 0  # lazy commits so far
        self._paid_through = 0  # of those, the ones known synced
        self._fd: int | None = None

    @property
    def owed(self) -> int:
        return self._owed_through - self._paid_through

    def owe(self) -> None:
        with self._counts:
            self._owed_through += 1
        self._due.set()

    def paid(self) -> None:
        with self._counts:
            self._paid_through = self._owed_through

    def run(self) -> None:
        name_os_thread()
        try:
            while True:
                self._due.wait()
                if self._stopping.wait(self._within):  # meanwhile, the window's outcomes gather
                    break
                self._due.clear()  # a stop() after this sets it again; one before is seen here
                if self._stopping.is_set():
                    break
                self.sync()
        finally:
            self.sync()  # nothing owed is left behind by a clean stop
            if self._fd is not None:
                os.close(self._fd)

    def sync(self) -> None:
        with self._counts:
            through = self._owed_through
        if through <= self._paid_through:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self._wal, os.O_RDONLY)
            _datasync(self._fd)
        except OSError as exc:
            log.warning("could not sync the ledger's WAL (%s); trying again", exc)
            self._due.set()  # owed still: try again after another window
            return
        with self._counts:
            self._paid_through = max(self._paid_through, through)

    def stop(self) -> None:
        self._stopping.set()
        self._due.set()


_datasync = getattr(os, "fdatasync", os.fsync)


def _as_ledger_failure(exc: Exception) -> Exception:
    """A write SQLite refused (a constraint, a full disk, a schema it does not fit) is a ledger that
    could not record: its caller answers `ledger_unavailable` and runs nothing, as for a failed
    batch. Anything else is the write's own answer and reaches its caller as raised."""
    return LedgerUnavailable(f"ledger write failed: {exc}") if isinstance(exc, sqlite3.Error) else exc


def _answer(batch: Sequence[_Queued], outcomes: Sequence[tuple[bool, Any]]) -> None:
    """Hand each write's outcome to its caller's event loop: one wake-up per loop and batch, not one
    per write (each costs a self-pipe write)."""
    settled: dict[Any, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
    for (_, future, loop), (ok, value) in zip(batch, outcomes, strict=True):
        settled.setdefault(loop, []).append((future, ok, value))
    for loop, items in settled.items():
        loop.call_soon_threadsafe(_settle_all, items)


def _settle_all(items: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for future, ok, value in items:
        if future.done():  # the caller was cancelled; the write still happened
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
