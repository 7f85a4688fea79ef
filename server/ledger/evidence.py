"""What a ledger transaction writes beside its audit entries: receipts and notification events.

Each backend collects the audit entries a transaction wrote and, just before it commits, hands them
here (`seal_sqlite`, `seal_postgres`): one signed receipt per entry, chained per writer
(`model/receipts.py`), and one outbox row per event a `[[notify]]` route wants. Both are therefore
in the same transaction as the change they prove or announce. Delivery of the outbox is the serving
layer's (`serve/notify.py`); it takes rows with a lease so replicas never send one event at once.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from commitgate.server.ledger.base import BUDGET_STATES, LedgerUnavailable, scope_of, sql_states
from commitgate.server.model.amounts import joined
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import State
from commitgate.server.model.receipts import GENESIS, at_text, chained_hash, digest

# The events a [[notify]] entry may ask for (docs/operating.md#notifications).
EVENTS = ("approval_waiting", "approval_expired", "unknown", "budget_near", "reconciled")


class KeyProblem(LedgerUnavailable):
    """The receipts key cannot be used, so nothing may be recorded: the message says which file and what to do."""


class Signer:
    """An Ed25519 key that signs receipts."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_hex = raw.hex()

    def sign(self, hash_hex: str) -> str:
        return self._key.sign(hash_hex.encode()).hex()

    @classmethod
    def load(cls, path: Path, *, create: bool) -> Signer:
        """The key in `path` (PEM, PKCS#8). `create`: a key file that does not exist yet is made (0600)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if not create:
                raise KeyProblem(
                    f"the receipts key file {path} does not exist: fix [receipts] key_file, or remove it to"
                    " use a key created in the state directory"
                ) from None
            return cls._create(path)
        except OSError as exc:
            raise KeyProblem(f"cannot read the receipts key file {path}: {exc.strerror or exc}") from None
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyProblem(f"the receipts key file {path} holds no usable private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyProblem(f"the receipts key file {path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def _create(cls, path: Path) -> Signer:
        """A new key, published whole: written to a file of its own, then linked into place, so a
        process starting at the same moment reads either no key or this one, never half of it."""
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        draft = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(pem)
                file.flush()
                os.fsync(file.fileno())
            os.link(draft, path)
        except FileExistsError:  # another process made it meanwhile: use theirs
            return cls.load(path, create=False)
        except OSError as exc:
            raise KeyProblem(f"cannot create the receipts key file {path}: {exc.strerror or exc}") from None
        finally:
            draft.unlink(missing_ok=True)
        return cls(key)


@dataclass(frozen=True, slots=True)
class Route:
    """A [[notify]] entry as the ledger needs it: which events of whose operations go to `target`."""

    target: str
    events: frozenset[str]
    principals: frozenset[str] | None = None

    def wants(self, event: str, principal: str) -> bool:
        return event in self.events and (self.principals is None or principal in self.principals)


@dataclass(frozen=True, slots=True)
class BudgetLine:
    """What `budget_near` needs of a budget: its limit, scope and window."""

    limit: Decimal
    per: str
    window_seconds: float


NEAR = Decimal("0.9")  # `budget_near`: a scope's spending reached 90 % of its limit
# The changes with which an operation spends (it is taken to run): the ones that may cross the mark.
_SPENDS = frozenset(
    {AuditEvent.CLAIMED, AuditEvent.RETRY_CLAIMED, AuditEvent.RERUN_CLAIMED, AuditEvent.APPROVED_CLAIMED}
)


def crossed(spent: Decimal, amount: Decimal, limit: Decimal) -> bool:
    """The spending that included `amount` took its scope across the mark (not already past it)."""
    return spent - amount < NEAR * limit <= spent


def event_of(audit_event: str, from_state: str | None, to_state: str | None) -> str | None:
    """The notification an audit entry causes, if any."""
    if audit_event == AuditEvent.APPROVAL_REQUESTED:
        return "approval_waiting"
    if audit_event == AuditEvent.APPROVAL_EXPIRED:
        return "approval_expired"
    if audit_event in (AuditEvent.RECONCILED_FOUND, AuditEvent.RECONCILED_NOT_FOUND, AuditEvent.RESOLVED):
        return "reconciled"
    if to_state == State.UNKNOWN and from_state != State.UNKNOWN:
        return "unknown"
    return None


class Evidence:
    """What this process adds to every ledger transaction: receipts (with a signer) and outbox rows
    (with routes). Each process signs its own chains, so replicas never contend for one."""

    def __init__(
        self,
        signer: Signer | None,
        routes: Sequence[Route] = (),
        budgets: Mapping[str, BudgetLine] | None = None,
    ) -> None:
        self.signer = signer
        self._routing: tuple[tuple[Route, ...], frozenset[str]] = ((), frozenset())
        self.budgets: Mapping[str, BudgetLine] = {}
        self.retarget(routes, budgets or {})
        self._process = uuid.uuid4().hex[:12]
        # (writer, connection) -> the writer's number in that SQLite file (`seal_sqlite`)
        self.numbers: dict[tuple[str, sqlite3.Connection], int] = {}
        self._lanes: list[Lane] = []
        self._next_lane = 0

    def retarget(self, routes: Sequence[Route], budgets: Mapping[str, BudgetLine]) -> None:
        """New routes (a policy reloaded). Each is one assignment: a transaction sealing meanwhile
        sees the old set or the new one."""
        heard = frozenset(event for route in routes for event in route.events)
        self.budgets = dict(budgets) if "budget_near" in heard else {}  # looked at only when someone listens
        self._routing = (tuple(routes), heard)  # the events some route wants: the others cost nothing

    @property
    def routes(self) -> tuple[Route, ...]:
        return self._routing[0]

    @property
    def active(self) -> bool:
        return self.signer is not None or bool(self.routes)

    def writer(self, lane: int | None = None) -> str:
        assert self.signer is not None
        chain = self._process if lane is None else f"{self._process}-{lane}"
        return f"{self.signer.public_hex}.{chain}"

    # PostgreSQL runs many transactions of one process at once: each takes a lane, a chain of its
    # own, for its duration; a lane whose transaction failed is dropped (its chain ends there).
    def take_lane(self) -> Lane:
        if self._lanes:
            return self._lanes.pop()
        self._next_lane += 1
        return Lane(self.writer(self._next_lane) if self.signer is not None else "", 0, GENESIS)

    def give_back(self, lane: Lane) -> None:
        self._lanes.append(lane)

    def spending(self, entries: Sequence[Sequence[Any]]) -> list[str]:
        """The operations among `entries` that spent (when `budget_near` is listened for)."""
        if not self.budgets:
            return []
        return [entry[0] for entry in entries if entry[2] in _SPENDS]

    def build(
        self, entries: Sequence[Sequence[Any]], writer: str, seq: int, prev: str, near: Collection[str] = ()
    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], int, str]:
        """Receipt rows and outbox rows for audit entries (operation_id, at, event, from_state,
        to_state, actor, principal, session, tool, arguments, result), and the chain's new head.
        `near`: operations whose spending took their budget across the `budget_near` mark."""
        receipts: list[tuple[Any, ...]] = []
        outbox: list[tuple[Any, ...]] = []
        signer = self.signer
        routes, heard = self._routing
        for (
            operation_id,
            at,
            event,
            from_state,
            to_state,
            actor,
            principal,
            session,
            tool,
            arguments,
            result,
        ) in entries:
            if signer is not None:
                seq += 1
                fields = (seq, writer, at_text(at), operation_id, principal, session, tool, event, to_state, actor,
                          digest(arguments), digest(result), prev)  # fmt: skip
                prev = chained_hash(*fields)
                receipts.append((*fields, prev, signer.sign(prev)))
            if not heard:
                continue
            notice = event_of(event, from_state, to_state)
            if near and event in _SPENDS and operation_id in near:
                notice = "budget_near"
            if notice in heard:
                outbox.extend(
                    ("ev_" + uuid.uuid4().hex, route.target, notice, operation_id, at, to_state, at)
                    for route in routes
                    if route.wants(notice, principal)
                )
        return receipts, outbox, seq, prev


@dataclass(slots=True)
class Lane:
    writer: str
    seq: int
    prev: str


_RECEIPT_COLUMNS = (
    "seq, writer, at, operation_id, principal, session, tool, transition, state, actor,"
    " arguments_sha256, result_sha256, prev, hash, sig"
)
_OUTBOX_COLUMNS = "event_id, target, event, operation_id, at, state, next_at"

# --- SQLite ----------------------------------------------------------------------------------------

SQLITE_MIGRATION = """
    CREATE TABLE IF NOT EXISTS receipt_writers (id INTEGER PRIMARY KEY, writer TEXT NOT NULL UNIQUE);
    CREATE TABLE IF NOT EXISTS receipts (
        writer_id INTEGER NOT NULL, seq INTEGER NOT NULL, at TEXT NOT NULL, operation_id TEXT NOT NULL,
        principal TEXT, session TEXT, tool TEXT, transition TEXT NOT NULL, state TEXT, actor TEXT,
        arguments_sha256 BLOB, result_sha256 BLOB, prev BLOB NOT NULL, hash BLOB NOT NULL, sig BLOB NOT NULL,
        PRIMARY KEY (writer_id, seq)
    ) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS outbox (
        event_id TEXT PRIMARY KEY, target TEXT NOT NULL, event TEXT NOT NULL, operation_id TEXT NOT NULL,
        at REAL NOT NULL, state TEXT, next_at REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
        lease_owner TEXT, lease_until REAL, delivered_at REAL, failed_at REAL, last_error TEXT
    );
    CREATE INDEX IF NOT EXISTS outbox_due ON outbox (next_at) WHERE delivered_at IS NULL AND failed_at IS NULL;
"""

# The audit entries named, each found by its primary key (driven by the list: a row-value IN over the
# audit table would scan it whole).
_DUE_COLUMNS = (
    "a.operation_id, a.at, a.event, a.from_state, a.to_state, a.actor, o.principal, o.session, o.tool,"
    " o.arguments, o.result, a.id"
)
_SQLITE_DUE_ONE = (
    f"SELECT {_DUE_COLUMNS} FROM audit a JOIN operations o ON o.operation_id = a.operation_id"
    " WHERE a.operation_id = ? AND a.id = ?"
)
_SQLITE_DUE = (
    f"SELECT {_DUE_COLUMNS} FROM (VALUES {{marks}}) AS v CROSS JOIN audit a"
    " ON a.operation_id = v.column1 AND a.id = v.column2 JOIN operations o ON o.operation_id = a.operation_id"
)
_SQLITE_WRITER = "SELECT id FROM receipt_writers WHERE writer = ?"
_SQLITE_HEAD = "SELECT seq, hash FROM receipts WHERE writer_id = ? ORDER BY seq DESC LIMIT 1"
_SQLITE_RECEIPT = f"INSERT INTO receipts ({_RECEIPT_COLUMNS.replace('writer', 'writer_id', 1)}) VALUES ({', '.join('?' * 15)})"
_HEX = (10, 11, 12, 13, 14)  # the digests, prev, hash and sig: stored as bytes (`_stored`)
SQLITE_RECEIPTS = (
    f"SELECT {_RECEIPT_COLUMNS.replace('writer', 'w.writer', 1)} FROM receipts JOIN receipt_writers w"
    " ON w.id = receipts.writer_id{where} ORDER BY w.writer, seq"
)
_SQLITE_OUTBOX = f"INSERT INTO outbox ({_OUTBOX_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"


def watch_sqlite(conn: sqlite3.Connection, due: list[tuple[str, int]]) -> None:
    """Collect, into `due`, every audit entry this connection writes (a trigger of this connection only)."""
    conn.create_function("commitgate_due", 2, lambda op, n: due.append((op, n)), deterministic=False)
    conn.execute(
        "CREATE TEMP TRIGGER IF NOT EXISTS commitgate_due AFTER INSERT ON main.audit"
        " BEGIN SELECT commitgate_due(NEW.operation_id, NEW.id); END"
    )


def seal_sqlite(
    conn: sqlite3.Connection,
    evidence: Evidence,
    due: list[tuple[str, int]],
    heads: Mapping[str, tuple[int, str]],
) -> tuple[str, tuple[int, str]] | None:
    """Before a commit: the receipts and events of the audit entries this transaction wrote.

    `due` may also name entries a rolled-back write had made: the join finds only those that exist.
    `heads`: each chain's last receipt (seq, hash) as of the last commit, kept by the caller instead
    of read in every transaction. Returns the chain and its head once this transaction commits (the
    caller keeps it only then: a head ahead of the file would leave a gap)."""
    if not due:
        return None
    keys = list(dict.fromkeys(due))
    due.clear()
    order = {key: i for i, key in enumerate(keys)}
    rows: list[Any] = []
    for start in range(0, len(keys), 400):
        chunk = keys[start : start + 400]
        sql = (
            _SQLITE_DUE_ONE
            if len(chunk) == 1
            else _SQLITE_DUE.format(marks=", ".join(["(?, ?)"] * len(chunk)))
        )
        rows += conn.execute(sql, [v for key in chunk for v in key]).fetchall()
    rows.sort(key=lambda row: order[(row[0], row[11])])
    writer, writer_id, head = "", 0, (0, GENESIS)
    if evidence.signer is not None:
        writer = evidence.writer()
        writer_id = _writer_id(conn, evidence, writer)
        head = heads.get(writer) or _sqlite_head(conn, writer_id)
    entries = [row[:11] for row in rows]
    near = _sqlite_near(conn, evidence, evidence.spending(entries))
    receipts, outbox, seq, prev = evidence.build(entries, writer, *head, near)
    if receipts:
        try:
            conn.execute(_SQLITE_RECEIPT, _stored(receipts[0], writer_id))
        except sqlite3.IntegrityError:
            # The kept head is behind the file (another writer of this chain on the file, or a
            # COMMIT that reported failure yet was kept): build again on the file's own head.
            receipts, outbox, seq, prev = evidence.build(
                entries, writer, *_sqlite_head(conn, writer_id), near
            )
            conn.execute(_SQLITE_RECEIPT, _stored(receipts[0], writer_id))
        if len(receipts) > 1:
            conn.executemany(_SQLITE_RECEIPT, [_stored(receipt, writer_id) for receipt in receipts[1:]])
    if outbox:
        conn.executemany(_SQLITE_OUTBOX, outbox)
    return (writer, (seq, prev)) if receipts else None


def _sqlite_head(conn: sqlite3.Connection, writer_id: int) -> tuple[int, str]:
    """The chain's last receipt in the file, (seq, hash); (0, GENESIS) for a chain not begun."""
    head = conn.execute(_SQLITE_HEAD, (writer_id,)).fetchone()
    return (0, GENESIS) if head is None else (head[0], head[1].hex())


def _writer_id(conn: sqlite3.Connection, evidence: Evidence, writer: str) -> int:
    """The number the file of `conn` gives `writer`. Kept once read back committed (such a row is
    never removed); the transaction that adds it may yet roll back, so that one is not kept."""
    known = evidence.numbers.get((writer, conn))
    if known is not None:
        return known
    row = conn.execute(_SQLITE_WRITER, (writer,)).fetchone()
    if row is None:  # this chain's first receipt
        return int(conn.execute("INSERT INTO receipt_writers (writer) VALUES (?)", (writer,)).lastrowid or 0)
    evidence.numbers[(writer, conn)] = int(row[0])
    return int(row[0])


def _stored(receipt: tuple[Any, ...], writer_id: int) -> tuple[Any, ...]:
    """A receipt row as SQLite keeps it: its writer's number, hex fields as bytes."""
    seq, _, *text, arguments, result, prev, hash_, sig = receipt
    digests = (None if d is None else bytes.fromhex(d) for d in (arguments, result))
    return (seq, writer_id, *text, *digests, bytes.fromhex(prev), bytes.fromhex(hash_), bytes.fromhex(sig))


def sqlite_receipt(row: Sequence[Any]) -> dict[str, Any]:
    """A receipt read back from SQLite, as it was signed."""
    fields = list(row)
    for i in _HEX:
        if isinstance(fields[i], bytes):
            fields[i] = fields[i].hex()
    return receipt_of(fields)


_SQLITE_SPENT = (
    "SELECT budget, budget_units, budget_nanos, principal, session, budget_spent_at FROM operations"
    " WHERE operation_id = ? AND budget IS NOT NULL AND budget_spent_at IS NOT NULL"
)
_SQLITE_SUM = (
    "SELECT coalesce(sum(budget_units), 0), coalesce(sum(budget_nanos), 0) FROM operations"
    " WHERE budget = ? AND (? IS NULL OR principal = ?) AND (? IS NULL OR session = ?) AND budget_spent_at > ?"
    f" AND state IN ({sql_states(BUDGET_STATES)}) AND (expires_at IS NULL OR expires_at > ?)"
)


def _sqlite_near(conn: sqlite3.Connection, evidence: Evidence, spending: Sequence[str]) -> set[str]:
    near = set()
    for operation_id in spending:
        row = conn.execute(_SQLITE_SPENT, (operation_id,)).fetchone()
        line = evidence.budgets.get(row[0]) if row is not None else None
        if row is None or line is None:
            continue
        budget, units, nanos, principal, session, at = row
        who, where = scope_of(line.per, principal, session)
        total = conn.execute(
            _SQLITE_SUM, (budget, who, who, where, where, at - line.window_seconds, at)
        ).fetchone()
        if crossed(joined(*total), joined(units, nanos), line.limit):
            near.add(operation_id)
    return near


# --- PostgreSQL ------------------------------------------------------------------------------------

POSTGRES_MIGRATION = """
    CREATE TABLE IF NOT EXISTS commitgate_receipts (
        seq bigint NOT NULL, writer text NOT NULL, at text NOT NULL, operation_id text NOT NULL,
        principal text, session text, tool text, transition text NOT NULL, state text, actor text,
        arguments_sha256 text, result_sha256 text, prev text NOT NULL, hash text NOT NULL, sig text NOT NULL,
        PRIMARY KEY (writer, seq)
    );
    CREATE TABLE IF NOT EXISTS commitgate_outbox (
        event_id text PRIMARY KEY, target text NOT NULL, event text NOT NULL, operation_id text NOT NULL,
        at double precision NOT NULL, state text, next_at double precision NOT NULL,
        attempts integer NOT NULL DEFAULT 0, lease_owner text, lease_until double precision,
        delivered_at double precision, failed_at double precision, last_error text
    );
    CREATE INDEX IF NOT EXISTS commitgate_outbox_due ON commitgate_outbox (next_at) WHERE delivered_at IS NULL AND failed_at IS NULL;
"""

# The audit entries this transaction wrote for the given operations: the rows whose xmin is ours
# (the ledger's functions open no subtransactions, so every row they insert carries the top xid).
_POSTGRES_DUE = (
    "SELECT a.operation_id, a.at, a.event, a.from_state, a.to_state, a.actor, o.principal, o.session, o.tool,"
    " o.arguments, o.result FROM commitgate_audit a JOIN commitgate_operations o ON o.operation_id = a.operation_id"
    " WHERE a.operation_id = ANY ($1::text[])"
    " AND a.xmin::text = (pg_current_xact_id()::text::bigint % 4294967296)::text ORDER BY a.id"
)
_POSTGRES_RECEIPT = f"INSERT INTO commitgate_receipts ({_RECEIPT_COLUMNS}) VALUES ({', '.join(f'${n}' for n in range(1, 16))})"
_POSTGRES_OUTBOX = f"INSERT INTO commitgate_outbox ({_OUTBOX_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"


async def seal_postgres(conn: Any, evidence: Evidence, lane: Lane, operation_ids: Sequence[str]) -> None:
    """Inside the transaction, after its step: receipts (on `lane`'s chain) and events of what it wrote."""
    if not operation_ids:
        return
    rows = await conn.fetch(_POSTGRES_DUE, list(dict.fromkeys(operation_ids)))
    if not rows:
        return
    entries = [tuple(row) for row in rows]
    near = await _postgres_near(conn, evidence, evidence.spending(entries))
    receipts, outbox, seq, prev = evidence.build(entries, lane.writer, lane.seq, lane.prev, near)
    if receipts:
        await conn.executemany(_POSTGRES_RECEIPT, receipts)
    if outbox:
        await conn.executemany(_POSTGRES_OUTBOX, outbox)
    lane.seq, lane.prev = seq, prev  # only kept if the transaction commits (else the lane is dropped)


_POSTGRES_SPENT = (
    "SELECT budget, budget_amount, principal, session, budget_spent_at FROM commitgate_operations"
    " WHERE operation_id = $1 AND budget IS NOT NULL AND budget_spent_at IS NOT NULL"
)
_POSTGRES_SUM = (
    "SELECT coalesce(sum(budget_amount), 0) FROM commitgate_operations"
    " WHERE budget = $1 AND ($2::text IS NULL OR principal = $2) AND ($3::text IS NULL OR session = $3)"
    f" AND budget_spent_at > $4 AND state IN ({sql_states(BUDGET_STATES)}) AND (expires_at IS NULL OR expires_at > $5)"
)


async def _postgres_near(conn: Any, evidence: Evidence, spending: Sequence[str]) -> set[str]:
    near = set()
    for operation_id in spending:
        row = await conn.fetchrow(_POSTGRES_SPENT, operation_id)
        line = evidence.budgets.get(row["budget"]) if row is not None else None
        if row is None or line is None:
            continue
        who, where = scope_of(line.per, row["principal"], row["session"])
        at = row["budget_spent_at"]
        total = await conn.fetchval(_POSTGRES_SUM, row["budget"], who, where, at - line.window_seconds, at)
        if crossed(Decimal(total), Decimal(row["budget_amount"]), line.limit):
            near.add(operation_id)
    return near


# --- reading and delivering, for both backends -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutboxItem:
    event_id: str
    target: str
    event: str
    operation_id: str
    at: float
    state: str | None
    attempts: int
    next_at: float
    delivered_at: float | None = None
    failed_at: float | None = None
    last_error: str | None = None


OUTBOX_SELECT = (
    "SELECT event_id, target, event, operation_id, at, state, attempts, next_at, delivered_at, failed_at,"
    " last_error FROM {table}"
)
RECEIPTS_SELECT = f"SELECT {_RECEIPT_COLUMNS} FROM {{table}}"


def receipt_of(row: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(_RECEIPT_COLUMNS.replace(" ", "").split(","), row, strict=True))


def outbox_item(row: Sequence[Any]) -> OutboxItem:
    return OutboxItem(*row)


_DUE_NOW = "delivered_at IS NULL AND failed_at IS NULL AND next_at <= {now} AND (lease_until IS NULL OR lease_until <= {now})"


ANY_DUE = f"SELECT 1 FROM outbox WHERE {_DUE_NOW.format(now='?')} LIMIT 1"


def sqlite_take(
    conn: sqlite3.Connection, owner: str, now: float, lease: float, limit: int
) -> list[OutboxItem]:
    """Due events, each leased to `owner` until `now + lease`: nobody else sends them meanwhile."""
    where = _DUE_NOW.format(now="?")
    rows = conn.execute(
        f"{OUTBOX_SELECT.format(table='outbox')} WHERE {where} ORDER BY next_at LIMIT ?", (now, now, limit)
    ).fetchall()
    conn.executemany(
        "UPDATE outbox SET lease_owner = ?, lease_until = ? WHERE event_id = ?",
        [(owner, now + lease, row[0]) for row in rows],
    )
    return [outbox_item(row) for row in rows]


def sqlite_settle(conn: sqlite3.Connection, item: OutboxItem, owner: str, settled: Settled) -> bool:
    return (
        conn.execute(
            "UPDATE outbox SET attempts = attempts + 1, lease_owner = NULL, lease_until = NULL, delivered_at = ?,"
            " failed_at = ?, next_at = ?, last_error = ? WHERE event_id = ? AND lease_owner = ?",
            (settled.delivered_at, settled.failed_at, settled.next_at, settled.error, item.event_id, owner),
        ).rowcount
        == 1
    )


async def postgres_take(conn: Any, owner: str, now: float, lease: float, limit: int) -> list[OutboxItem]:
    rows = await conn.fetch(
        "UPDATE commitgate_outbox SET lease_owner = $1, lease_until = $2 WHERE event_id IN ("
        f" SELECT event_id FROM commitgate_outbox WHERE {_DUE_NOW.format(now='$3')}"
        " ORDER BY next_at LIMIT $4 FOR UPDATE SKIP LOCKED)"
        " RETURNING event_id, target, event, operation_id, at, state, attempts, next_at, delivered_at, failed_at,"
        " last_error",
        owner,
        now + lease,
        now,
        limit,
    )
    return [outbox_item(tuple(row)) for row in rows]


async def postgres_settle(conn: Any, item: OutboxItem, owner: str, settled: Settled) -> bool:
    status = await conn.execute(
        "UPDATE commitgate_outbox SET attempts = attempts + 1, lease_owner = NULL, lease_until = NULL,"
        " delivered_at = $1, failed_at = $2, next_at = $3, last_error = $4 WHERE event_id = $5 AND lease_owner = $6",
        settled.delivered_at,
        settled.failed_at,
        settled.next_at,
        settled.error,
        item.event_id,
        owner,
    )
    return bool(status == "UPDATE 1")


@dataclass(frozen=True, slots=True)
class Settled:
    """How one delivery attempt ended: delivered, failed for good, or due again at `next_at`."""

    next_at: float
    delivered_at: float | None = None
    failed_at: float | None = None
    error: str | None = None


# Reads for `ops verify`, `ops export` and `ops notifications` (same SQL on both backends but the table names).
def receipts_sql(table: str, since: bool, mark: str) -> str:
    where = f" WHERE at >= {mark}" if since else ""
    return f"{RECEIPTS_SELECT.format(table=table)}{where} ORDER BY writer, seq"


def undelivered_sql(table: str) -> str:
    return f"{OUTBOX_SELECT.format(table=table)} WHERE delivered_at IS NULL ORDER BY at"


class Evidenced(Protocol):
    """What both backends offer beside the Ledger interface for receipts and the outbox."""

    def attach(self, evidence: Evidence) -> None: ...

    async def outbox_take(self, owner: str, now: float, lease: float, limit: int) -> list[OutboxItem]: ...

    async def outbox_settle(self, item: OutboxItem, owner: str, settled: Settled) -> bool: ...

    async def undelivered(self) -> list[OutboxItem]: ...

    async def receipts(self, since: float | None = None) -> list[dict[str, Any]]: ...

    async def stored_digests(self) -> dict[str, tuple[str | None, str | None]]:
        """Each operation's stored arguments and result, as digests (`digest`)."""
        ...
