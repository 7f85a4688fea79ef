"""Demo tools acting on an embedded sandbox "system of record".

The sandbox is a SQLite file that tests and the demo count side effects in. It
does NOT deduplicate by idempotency key (that is commitgate's job): it only
records the key, so status checks and tests can look effects up by it.

Fault injection (env `COMMITGATE_SANDBOX_FAULTS`) makes the guard's work
visible: a comma-separated list of `tool.kind=value` (docs/features.md#injecting-faults-into-the-demo-tools). Values carry their unit so none can be misread: `2x` fires twice in
all (a budget shared by every process on the store, kept across restarts),
`50%` fires on about half of the calls, `500ms`/`2s` are times. A spec that
does not parse stops the server at start rather than failing calls.

Annotations are deliberately evaluated (no `from __future__ import annotations`)
so `inspect.signature` sees the real `OperationContext` type.
"""

import contextlib
import os
import random
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import platformdirs

from commitgate.server.model.context import OperationContext
from commitgate.server.model.outcomes import AmbiguousError, PermanentError, RetryableError

T = TypeVar("T")

ENV_PATH = "COMMITGATE_SANDBOX"
ENV_FAULTS = "COMMITGATE_SANDBOX_FAULTS"
DECLINED_CARD = "4000000000000002"
CRASH_EXIT_CODE = 137

# Every table with its columns; `count`/`rows` validate names against this (no SQL injection).
# `principal`/`session` scope the recorded key the way commitgate scopes operations.
_SCOPE = ("idempotency_key TEXT", "principal TEXT", "session TEXT", "created_at TEXT NOT NULL")
SCHEMA: dict[str, tuple[str, ...]] = {
    "charges": (
        "id TEXT PRIMARY KEY",
        "card TEXT NOT NULL",
        "amount_cents INTEGER NOT NULL",
        "description TEXT NOT NULL DEFAULT ''",
        "refunded_cents INTEGER NOT NULL DEFAULT 0",
        *_SCOPE,
    ),
    "refunds": ("id TEXT PRIMARY KEY", "charge_id TEXT NOT NULL", "amount_cents INTEGER NOT NULL", *_SCOPE),
    "emails": ("id TEXT PRIMARY KEY", "to_addr TEXT NOT NULL", "subject TEXT", "body TEXT", *_SCOPE),
    "tickets": ("id TEXT PRIMARY KEY", "title TEXT NOT NULL", "body TEXT", *_SCOPE),
    "bookings": (
        "id TEXT PRIMARY KEY",
        "resource TEXT NOT NULL",
        "customer TEXT NOT NULL",
        "status TEXT NOT NULL CHECK (status IN ('reserved', 'confirmed', 'released'))",
        "released_key TEXT",
        *_SCOPE,
    ),
    "notices": ("id TEXT PRIMARY KEY", "booking_id TEXT NOT NULL", "kind TEXT NOT NULL", *_SCOPE),
    "tasks": ("id TEXT PRIMARY KEY", "label TEXT", "seconds REAL", *_SCOPE),
    "balances": ("card TEXT PRIMARY KEY", "cents INTEGER NOT NULL"),
    # Remaining budget of integer faults, shared by all processes; keyed by the budget
    # so editing the spec to a new number starts a fresh budget.
    "faults": (
        "tool TEXT NOT NULL",
        "kind TEXT NOT NULL",
        "budget INTEGER NOT NULL",
        "remaining INTEGER NOT NULL",
        "PRIMARY KEY (tool, kind, budget)",
    ),
}
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS charges_key ON charges(idempotency_key)",
    "CREATE INDEX IF NOT EXISTS refunds_key ON refunds(idempotency_key)",
    "CREATE INDEX IF NOT EXISTS emails_key ON emails(idempotency_key)",
    "CREATE INDEX IF NOT EXISTS tickets_key ON tickets(idempotency_key)",
    "CREATE INDEX IF NOT EXISTS bookings_key ON bookings(idempotency_key)",
)


def _columns(table: str) -> set[str]:
    return {c.split()[0] for c in SCHEMA[table] if not c.startswith("PRIMARY KEY")}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- store


class SandboxStore:
    """The sandbox database; a fresh short-lived connection per operation, so any thread or process may use it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.outbox = self.path.parent / "outbox"
        self.outbox.mkdir(exist_ok=True)
        self._init_schema()

    def _init_schema(self) -> None:
        self._enable_wal()
        with self.transaction() as conn:
            for table, cols in SCHEMA.items():
                conn.execute(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(cols)})")
            for sql in _INDEXES:
                conn.execute(sql)

    def _enable_wal(self) -> None:
        # WAL is persistent in the file. Switching a fresh file can fail with "database is locked"
        # without consulting busy_timeout when several processes create it at once, so retry.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                with self.connect() as conn:
                    if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                        conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(random.uniform(0.005, 0.03))

    @contextlib.contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE) so writers queue on busy_timeout
        # instead of failing on a lock upgrade.
        conn = sqlite3.connect(self.path, timeout=5.0, isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=5000")
            conn.execute("PRAGMA synchronous=NORMAL")
            yield conn
        finally:
            conn.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def count(self, table: str, **where: Any) -> int:
        sql, params = _select(table, "COUNT(*)", where)
        with self.connect() as conn:
            return int(conn.execute(sql, params).fetchone()[0])

    def rows(self, table: str, **where: Any) -> list[dict[str, Any]]:
        sql, params = _select(table, "*", where)
        with self.connect() as conn:
            return [dict(r) for r in conn.execute(sql + " ORDER BY rowid", params)]

    def reset(self) -> None:
        """Delete every row (fault budgets included) and every outbox file."""
        with self.transaction() as conn:
            for table in SCHEMA:
                conn.execute(f"DELETE FROM {table}")
        for f in self.outbox.glob("*.eml"):
            f.unlink(missing_ok=True)

    def take_budget(self, conn: sqlite3.Connection, tool: str, kind: str, budget: int) -> bool:
        """Consume one occurrence of an integer fault inside the caller's transaction; True if it fires."""
        conn.execute(
            "INSERT OR IGNORE INTO faults (tool, kind, budget, remaining) VALUES (?, ?, ?, ?)",
            (tool, kind, budget, budget),
        )
        cur = conn.execute(
            "UPDATE faults SET remaining = remaining - 1 WHERE tool = ? AND kind = ? AND budget = ? AND remaining > 0",
            (tool, kind, budget),
        )
        return cur.rowcount == 1


def _select(table: str, what: str, where: dict[str, Any]) -> tuple[str, list[Any]]:
    if table not in SCHEMA:
        raise ValueError(f"unknown sandbox table {table!r}; known: {', '.join(SCHEMA)}")
    unknown = set(where) - _columns(table)
    if unknown:
        raise ValueError(f"unknown column(s) {sorted(unknown)} for table {table!r}")
    clauses = [f"{col} IS ?" for col in where]  # IS so that None matches NULL
    sql = f"SELECT {what} FROM {table}" + (" WHERE " + " AND ".join(clauses) if clauses else "")
    return sql, list(where.values())


_stores: dict[Path, SandboxStore] = {}
_stores_lock = threading.Lock()


def sandbox_path() -> Path:
    """The sandbox file: `$COMMITGATE_SANDBOX`, else `sandbox.db` in commitgate's user state directory."""
    env = os.environ.get(ENV_PATH)
    if env:
        return Path(env).expanduser().resolve()
    return (platformdirs.user_state_path("commitgate") / "sandbox.db").resolve()


def store() -> SandboxStore:
    """The store for the current `$COMMITGATE_SANDBOX` (re-read on every call so tests can switch it)."""
    path = sandbox_path()
    with _stores_lock:
        cached = _stores.get(path)
        if cached is None or not path.exists():  # re-create if a test deleted the file
            cached = _stores[path] = SandboxStore(path)
        return cached


def count(table: str, **where: Any) -> int:
    """Rows of `table` matching `where` (column=value, None matches NULL) in the current sandbox."""
    return store().count(table, **where)


def rows(table: str, **where: Any) -> list[dict[str, Any]]:
    """Rows of `table` matching `where` as dicts, in insertion order."""
    return store().rows(table, **where)


def reset() -> None:
    """Empty the current sandbox (rows, fault budgets, outbox)."""
    store().reset()


# --------------------------------------------------------------------------- faults

PRE_KINDS = frozenset({"latency", "fail_before", "fail_permanent"})
POST_KINDS = frozenset({"lose_ack", "crash_after_effect", "timeout_after_effect"})
SECONDS_KINDS = frozenset({"latency", "timeout_after_effect"})
EFFECT_TOOLS = frozenset(
    {
        "charge_card",
        "refund",
        "send_email",
        "create_ticket",
        "reserve",
        "release",
        "confirm",
        "send_cancellation_notice",
        "slow_task",
    }
)
READ_TOOLS = frozenset(
    {
        "find_charge",
        "find_refund",
        "find_email",
        "find_ticket",
        "find_reservation",
        "find_release",
        "get_balance",
    }
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One parsed `tool.kind=value` entry."""

    tool: str
    kind: str
    seconds: float = 0.0  # latency / timeout_after_effect: "500ms", "2s"
    probability: float | None = None  # "50%": fires per call with this probability
    budget: int | None = None  # "2x": fires this many times in total, across processes and restarts


def parse_faults(spec: str) -> dict[str, dict[str, Fault]]:
    """Parse a fault spec into {tool: {kind: Fault}}; raises ValueError naming the bad entry."""
    out: dict[str, dict[str, Fault]] = {}
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        fault = _parse_entry(entry)
        if fault.kind in out.setdefault(fault.tool, {}):
            raise ValueError(f"bad fault entry {entry!r}: {fault.tool}.{fault.kind} given twice")
        out[fault.tool][fault.kind] = fault
    return out


def _parse_entry(entry: str) -> Fault:
    name, sep, value = (s.strip() for s in entry.partition("="))
    tool, dot, kind = name.partition(".")
    if not (sep and dot and value):
        raise ValueError(f"bad fault entry {entry!r}: expected tool.kind=value")
    if tool not in EFFECT_TOOLS | READ_TOOLS:
        raise ValueError(f"bad fault entry {entry!r}: unknown tool {tool!r}")
    if kind not in PRE_KINDS | POST_KINDS:
        raise ValueError(
            f"bad fault entry {entry!r}: unknown kind {kind!r}; known: {', '.join(sorted(PRE_KINDS | POST_KINDS))}"
        )
    if kind in POST_KINDS and tool in READ_TOOLS:
        raise ValueError(f"bad fault entry {entry!r}: {kind} needs a tool with a side effect")
    fault = _fault_value(tool, kind, value)
    if fault is None:
        form = TIME_FORM if kind in SECONDS_KINDS else CHANCE_FORM
        raise ValueError(f"bad fault entry {entry!r}: bad value {value!r}; {kind} takes {form}")
    return fault


TIME_FORM = "a time with its unit, like '500ms' or '2s'"
CHANCE_FORM = (
    "a count like '1x' (fires that many times in all, shared by every process) "
    "or a chance like '50%' (per call)"
)
_TIME = re.compile(r"(\d+(?:\.\d+)?)(ms|s)")
_COUNT = re.compile(r"(\d+)x")
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)%")


def _fault_value(tool: str, kind: str, value: str) -> Fault | None:
    if kind in SECONDS_KINDS:
        time_ = _TIME.fullmatch(value)
        if time_ is None:
            return None
        return Fault(tool, kind, seconds=float(time_.group(1)) * (0.001 if time_.group(2) == "ms" else 1.0))
    count, percent = _COUNT.fullmatch(value), _PERCENT.fullmatch(value)
    if count is not None:
        return Fault(tool, kind, budget=int(count.group(1)))
    if percent is not None and float(percent.group(1)) <= 100:
        return Fault(tool, kind, probability=float(percent.group(1)) / 100)
    return None


def check_fault_spec() -> None:
    """Parse the environment's spec now: a mistake stops the server at start, not each call."""
    spec = os.environ.get(ENV_FAULTS, "")
    try:
        parse_faults(spec)
    except ValueError as exc:
        raise ValueError(f"{ENV_FAULTS}: {exc}") from None


_parsed: tuple[str, dict[str, dict[str, Fault]]] = ("", {})


def faults_for(tool: str) -> dict[str, Fault]:
    """The faults configured for `tool` by the current environment (parse cached by spec string)."""
    global _parsed
    spec = os.environ.get(ENV_FAULTS, "")
    cached_spec, parsed = _parsed
    if spec != cached_spec:
        parsed = parse_faults(spec)
        _parsed = (spec, parsed)  # a tuple swap is atomic, so racing threads at worst parse twice
    return parsed.get(tool, {})


def _fires(store_: SandboxStore, conn: sqlite3.Connection, fault: Fault | None) -> bool:
    if fault is None:
        return False
    if fault.probability is not None:
        return random.random() < fault.probability
    if fault.budget is not None:
        return store_.take_budget(conn, fault.tool, fault.kind, fault.budget)
    return True  # seconds kinds always apply


def _pre_faults(store_: SandboxStore, tool: str, faults: dict[str, Fault]) -> None:
    """Raise the configured pre-effect failure, if it fires; nothing has been applied yet."""
    if not faults.keys() & {"fail_permanent", "fail_before"}:
        return
    with store_.transaction() as conn:  # budget consumption is committed even though we raise
        permanent = _fires(store_, conn, faults.get("fail_permanent"))
        retryable = not permanent and _fires(store_, conn, faults.get("fail_before"))
    if permanent:
        raise PermanentError(f"injected fault: {tool} rejected (fail_permanent)")
    if retryable:
        raise RetryableError(f"injected fault: {tool} failed before any effect (fail_before)")


@dataclass(frozen=True, slots=True)
class _After:
    """Post-effect faults decided inside the effect's own transaction (so a budget is spent iff applied)."""

    tool: str
    sleep: float = 0.0
    crash: bool = False
    lose_ack: bool = False


def _decide_after(
    store_: SandboxStore, conn: sqlite3.Connection, tool: str, faults: dict[str, Fault]
) -> _After:
    timeout = faults.get("timeout_after_effect")
    return _After(
        tool,
        sleep=timeout.seconds if timeout else 0.0,
        crash=_fires(store_, conn, faults.get("crash_after_effect")),
        lose_ack=_fires(store_, conn, faults.get("lose_ack")),
    )


def _finish(after: _After) -> None:
    """Apply post-effect faults once the effect is durably committed."""
    if after.crash:
        os._exit(CRASH_EXIT_CODE)  # a crash between the side effect and the ledger write
    if after.lose_ack:
        raise AmbiguousError(f"acknowledgement lost ({after.tool} was applied)")


def _commit_effect(
    store_: SandboxStore, tool: str, faults: dict[str, Fault], apply: Callable[[sqlite3.Connection], T]
) -> tuple[T, _After]:
    with store_.transaction() as conn:
        result = apply(conn)
        after = _decide_after(store_, conn, tool, faults)
    return result, after


def _effect(tool: str, apply: Callable[[sqlite3.Connection], T]) -> T:
    """Run a side effect in one transaction, wrapped in its configured faults (sync tools)."""
    faults = faults_for(tool)
    store_ = store()
    if "latency" in faults:
        time.sleep(faults["latency"].seconds)
    _pre_faults(store_, tool, faults)
    result, after = _commit_effect(store_, tool, faults, apply)
    if after.sleep:
        time.sleep(after.sleep)
    _finish(after)
    return result


def _read(tool: str, query: Callable[[sqlite3.Connection], T]) -> T:
    """Run a read (status check, balance) behind its pre-effect faults, e.g. to make a check unable to tell."""
    faults = faults_for(tool)
    store_ = store()
    if "latency" in faults:
        time.sleep(faults["latency"].seconds)
    _pre_faults(store_, tool, faults)
    with store_.connect() as conn:
        return query(conn)


# --------------------------------------------------------------------------- helpers for tools


def _scope(ctx: OperationContext | None) -> dict[str, Any]:
    if ctx is None:
        return {"idempotency_key": None, "principal": None, "session": None}
    return {"idempotency_key": ctx.idempotency_key, "principal": ctx.principal, "session": ctx.session}


def _insert(conn: sqlite3.Connection, table: str, ctx: OperationContext | None, **values: Any) -> None:
    values |= _scope(ctx) | {"created_at": _now()}
    cols = ", ".join(values)
    marks = ", ".join("?" for _ in values)
    conn.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", list(values.values()))


def _find_by_key(
    conn: sqlite3.Connection, table: str, ctx: OperationContext | None, **where: Any
) -> sqlite3.Row | None:
    """The row this operation recorded: same key, principal, session and arguments."""
    if ctx is None or not ctx.idempotency_key:
        # A status check must raise when it cannot tell; without a key it cannot.
        raise ValueError("a status check needs the operation's idempotency key")
    where |= _scope(ctx)
    sql, params = _select(table, "*", where)
    row: sqlite3.Row | None = conn.execute(sql + " ORDER BY rowid LIMIT 1", params).fetchone()
    return row


def _charge_result(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "charge_id": row["id"],
        "card": row["card"],
        "amount_cents": row["amount_cents"],
        "status": "succeeded",
    }


def _booking(conn: sqlite3.Connection, booking_id: str) -> sqlite3.Row:
    row: sqlite3.Row | None = conn.execute("SELECT * FROM bookings WHERE id = ?", (booking_id,)).fetchone()
    if row is None:
        raise PermanentError(f"no such booking: {booking_id}")
    return row


def _booking_result(row: sqlite3.Row, status: str) -> dict[str, Any]:
    return {"booking_id": row["id"], "resource": row["resource"], "status": status}


# --------------------------------------------------------------------------- payments


def charge_card(
    card: str, amount_cents: int, description: str = "", ctx: OperationContext | None = None
) -> dict[str, Any]:
    """Charge a payment card `amount_cents` (integer cents, > 0) in the sandbox and return the charge."""

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        if amount_cents <= 0:
            raise PermanentError(f"amount_cents must be positive, got {amount_cents}")
        if card == DECLINED_CARD:
            raise PermanentError("card declined")
        charge_id = _new_id("ch")
        _insert(
            conn, "charges", ctx, id=charge_id, card=card, amount_cents=amount_cents, description=description
        )
        return {"charge_id": charge_id, "card": card, "amount_cents": amount_cents, "status": "succeeded"}

    return _effect("charge_card", apply)


def find_charge(
    card: str, amount_cents: int, description: str = "", ctx: OperationContext | None = None
) -> dict[str, Any] | None:
    """Status check for charge_card: the charge made with this idempotency key, or null if none was made."""

    def query(conn: sqlite3.Connection) -> dict[str, Any] | None:
        row = _find_by_key(
            conn, "charges", ctx, card=card, amount_cents=amount_cents, description=description
        )
        return _charge_result(row) if row else None

    return _read("find_charge", query)


def refund(charge_id: str, amount_cents: int, ctx: OperationContext | None = None) -> dict[str, Any]:
    """Refund `amount_cents` (integer cents) of an earlier charge, at most what is left unrefunded."""

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        charge = conn.execute("SELECT * FROM charges WHERE id = ?", (charge_id,)).fetchone()
        if charge is None:
            raise PermanentError(f"no such charge: {charge_id}")
        left = charge["amount_cents"] - charge["refunded_cents"]
        if amount_cents <= 0 or amount_cents > left:
            raise PermanentError(f"cannot refund {amount_cents} cents of {charge_id}: {left} cents left")
        refund_id = _new_id("re")
        _insert(conn, "refunds", ctx, id=refund_id, charge_id=charge_id, amount_cents=amount_cents)
        conn.execute(
            "UPDATE charges SET refunded_cents = refunded_cents + ? WHERE id = ?", (amount_cents, charge_id)
        )
        return {"refund_id": refund_id, "charge_id": charge_id, "amount_cents": amount_cents}

    return _effect("refund", apply)


def find_refund(
    charge_id: str, amount_cents: int, ctx: OperationContext | None = None
) -> dict[str, Any] | None:
    """Status check for refund: the refund made with this idempotency key, or null if none was made."""

    def query(conn: sqlite3.Connection) -> dict[str, Any] | None:
        row = _find_by_key(conn, "refunds", ctx, charge_id=charge_id, amount_cents=amount_cents)
        return {"refund_id": row["id"], "charge_id": charge_id, "amount_cents": amount_cents} if row else None

    return _read("find_refund", query)


def get_balance(card: str) -> dict[str, Any]:
    """Read a card's balance in cents: its charges minus refunds plus any opening balance (no side effect)."""

    def query(conn: sqlite3.Connection) -> dict[str, Any]:
        charged = conn.execute(
            "SELECT COALESCE(SUM(amount_cents - refunded_cents), 0) FROM charges WHERE card = ?", (card,)
        ).fetchone()[0]
        opening = conn.execute(
            "SELECT COALESCE(SUM(cents), 0) FROM balances WHERE card = ?", (card,)
        ).fetchone()[0]
        return {"card": card, "cents": int(charged) + int(opening)}

    return _read("get_balance", query)


# --------------------------------------------------------------------------- messages and tickets


def send_email(to: str, subject: str, body: str, ctx: OperationContext | None = None) -> dict[str, Any]:
    """Send an email to `to` with a subject and plain-text body, and return its message id."""
    outbox = store().outbox

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        message_id = _new_id("msg")
        _insert(conn, "emails", ctx, id=message_id, to_addr=to, subject=subject, body=body)
        _write_outbox(
            outbox, message_id, to, subject, body
        )  # before COMMIT: a failed write rolls back the row
        return {"message_id": message_id, "to": to}

    return _effect("send_email", apply)


def _write_outbox(outbox: Path, message_id: str, to: str, subject: str, body: str) -> None:
    tmp = outbox / f".{message_id}.tmp"
    tmp.write_text(f"Message-ID: <{message_id}@sandbox>\nTo: {to}\nSubject: {subject}\n\n{body}\n", "utf-8")
    tmp.replace(outbox / f"{message_id}.eml")  # atomic, so readers never see half a message


def find_email(
    to: str, subject: str, body: str, ctx: OperationContext | None = None
) -> dict[str, Any] | None:
    """Status check for send_email: the email sent with this idempotency key, or null if none was sent."""

    def query(conn: sqlite3.Connection) -> dict[str, Any] | None:
        row = _find_by_key(conn, "emails", ctx, to_addr=to, subject=subject, body=body)
        return {"message_id": row["id"], "to": to} if row else None

    return _read("find_email", query)


def create_ticket(title: str, body: str = "", ctx: OperationContext | None = None) -> dict[str, Any]:
    """Open a support ticket with a title and optional body, and return its ticket id."""

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        ticket_id = _new_id("tk")
        _insert(conn, "tickets", ctx, id=ticket_id, title=title, body=body)
        return {"ticket_id": ticket_id, "title": title}

    return _effect("create_ticket", apply)


def find_ticket(title: str, body: str = "", ctx: OperationContext | None = None) -> dict[str, Any] | None:
    """Status check for create_ticket: the ticket opened with this idempotency key, or null if none was."""

    def query(conn: sqlite3.Connection) -> dict[str, Any] | None:
        row = _find_by_key(conn, "tickets", ctx, title=title, body=body)
        return {"ticket_id": row["id"], "title": title} if row else None

    return _read("find_ticket", query)


# --------------------------------------------------------------------------- bookings


def reserve(resource: str, customer: str, ctx: OperationContext | None = None) -> dict[str, Any]:
    """Reserve `resource` for `customer` (held until confirmed or released) and return the booking id."""

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        booking_id = _new_id("bk")
        _insert(conn, "bookings", ctx, id=booking_id, resource=resource, customer=customer, status="reserved")
        return {"booking_id": booking_id, "resource": resource, "status": "reserved"}

    return _effect("reserve", apply)


def find_reservation(
    resource: str, customer: str, ctx: OperationContext | None = None
) -> dict[str, Any] | None:
    """Status check for reserve: the booking made with this idempotency key, or null if none was made."""

    def query(conn: sqlite3.Connection) -> dict[str, Any] | None:
        row = _find_by_key(conn, "bookings", ctx, resource=resource, customer=customer)
        return {"booking_id": row["id"], "resource": resource, "status": "reserved"} if row else None

    return _read("find_reservation", query)


def release(booking_id: str, ctx: OperationContext | None = None) -> dict[str, Any]:
    """Release a reserved or confirmed booking (undoes reserve); releasing the same booking twice is an error."""

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        row = _booking(conn, booking_id)
        if row["status"] == "released":
            # Strict on purpose: a compensation that runs twice must show up as a failure.
            raise PermanentError(f"booking {booking_id} is already released")
        key = ctx.idempotency_key if ctx else None
        conn.execute(
            "UPDATE bookings SET status = 'released', released_key = ? WHERE id = ?", (key, booking_id)
        )
        return _booking_result(row, "released")

    return _effect("release", apply)


def find_release(booking_id: str, ctx: OperationContext | None = None) -> dict[str, Any] | None:
    """Status check for release: the booking if it was released with this idempotency key, else null."""

    def query(conn: sqlite3.Connection) -> dict[str, Any] | None:
        if ctx is None or not ctx.idempotency_key:
            raise ValueError("a status check needs the operation's idempotency key")
        row = conn.execute(
            "SELECT * FROM bookings WHERE id = ? AND status = 'released' AND released_key = ?",
            (booking_id, ctx.idempotency_key),
        ).fetchone()
        return _booking_result(row, "released") if row else None

    return _read("find_release", query)


def confirm(booking_id: str, ctx: OperationContext | None = None) -> dict[str, Any]:
    """Confirm a reserved booking so it is kept; fails if the booking was released or already confirmed."""

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        row = _booking(conn, booking_id)
        if row["status"] != "reserved":
            raise PermanentError(f"booking {booking_id} is {row['status']}, not reserved")
        conn.execute("UPDATE bookings SET status = 'confirmed' WHERE id = ?", (booking_id,))
        return _booking_result(row, "confirmed")

    return _effect("confirm", apply)


def send_cancellation_notice(booking_id: str, ctx: OperationContext | None = None) -> dict[str, Any]:
    """Notify the customer of a booking that it was cancelled, and return the notice id."""

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        _booking(conn, booking_id)
        notice_id = _new_id("nt")
        _insert(conn, "notices", ctx, id=notice_id, booking_id=booking_id, kind="cancellation")
        return {"notice_id": notice_id, "booking_id": booking_id, "kind": "cancellation"}

    return _effect("send_cancellation_notice", apply)


# --------------------------------------------------------------------------- long-running


async def slow_task(seconds: float, label: str = "", ctx: OperationContext | None = None) -> dict[str, Any]:
    """Run a task that takes `seconds` seconds, then record it and return its task id."""
    faults = faults_for("slow_task")
    store_ = store()
    if "latency" in faults:
        await anyio.sleep(faults["latency"].seconds)
    await anyio.to_thread.run_sync(_pre_faults, store_, "slow_task", faults)
    await anyio.sleep(seconds)

    def apply(conn: sqlite3.Connection) -> dict[str, Any]:
        task_id = _new_id("task")
        _insert(conn, "tasks", ctx, id=task_id, label=label, seconds=seconds)
        return {"task_id": task_id, "label": label, "seconds": seconds}

    # SQLite may wait on busy_timeout: keep that off the event loop.
    result, after = await anyio.to_thread.run_sync(
        partial(_commit_effect, store_, "slow_task", faults, apply)
    )
    if after.sleep:
        await anyio.sleep(after.sleep)
    _finish(after)
    return result


check_fault_spec()  # at import, which is when a server builds its tools
