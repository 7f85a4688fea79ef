"""The threads of the SQLite ledger: the writer (group commit) and the checkpointer."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from commitgate.server.ledger.base import LedgerUnavailable
from commitgate.server.ledger.sqlite._writes import run_writes

T = TypeVar("T")

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
    """Runs ledger writes on one connection, committing everything queued in one transaction."""

    _STOP = object()

    def __init__(self, path: Path, synchronous: str, busy_timeout_ms: int) -> None:
        super().__init__(name="commitgate-ledger-writer", daemon=True)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
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
        self._lock = threading.Lock()  # one write in flight in this process: a batch or an inline write
        self._checkpointer = _Checkpointer(path, synchronous, self._lock)
        self.batches = 0
        self._in_batch = False
        self.writes = 0

    def submit(self, write: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if not self.is_alive():  # closed (or crashed): nobody would ever answer
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
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:
                return False, None  # locked by another process: let the writer wait for it
            try:
                value = write(conn)
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

        Sharing the inline writes' connection (and so their page cache) matters more than the read
        itself: between the requests of a real server the CPU caches are cold, and a second
        connection's pages cost a claim about 50 µs more (measured with caches flushed per call).
        """
        return self._inline.execute(sql, params).fetchone()

    @property
    def busy(self) -> bool:
        """A batch is being committed or writes are waiting for the next one."""
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
        # One wake-up per event loop and batch, not one per write: each costs a self-pipe write.
        settled: dict[Any, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
        for (_, future, loop), (ok, value) in zip(batch, outcomes, strict=True):
            settled.setdefault(loop, []).append((future, ok, value))
        for loop, items in settled.items():
            loop.call_soon_threadsafe(_settle_all, items)

    def _together(self, writes: list[Callable[[sqlite3.Connection], Any]]) -> list[tuple[bool, Any]] | None:
        """All writes in one transaction; None (everything rolled back) as soon as one fails."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            outcomes = [(True, value) for value in run_writes(conn, writes)]
        except Exception:
            conn.execute("ROLLBACK")
            return None
        conn.execute("COMMIT")
        return outcomes

    def _isolated(self, writes: list[Callable[[sqlite3.Connection], Any]]) -> list[tuple[bool, Any]]:
        """All writes in one transaction, each in a savepoint: a failing write takes only itself down."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        outcomes: list[tuple[bool, Any]] = []
        for write in writes:
            conn.execute("SAVEPOINT step")
            try:
                outcomes.append((True, write(conn)))
            except Exception as exc:
                conn.execute("ROLLBACK TO step")
                outcomes.append((False, exc))
            conn.execute("RELEASE step")
        conn.execute("COMMIT")
        return outcomes


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
    if future.done():  # the caller was cancelled; the write still happened
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
