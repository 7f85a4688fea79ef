"""What only the PostgreSQL ledger has to show: replicas (pools, processes) racing on one database.

The shared contract suite (test_ledger_contract.py) covers the semantics on this
backend too. Races here are made real, not hoped for: a `Gate` holds a lock
until every contender is queued behind it in PostgreSQL, then lets them all go.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from support.ledgers import OUTCOME_EVENTS
from support.postgres import SCHEMA_OBJECTS, fresh_url, private_ledger

from commitgate.server.bench.pgledger import run_pg_bench
from commitgate.server.ledger import open_ledger
from commitgate.server.ledger.base import (
    ClaimKind,
    ClaimRequest,
    Lease,
    LedgerUnavailable,
    Transition,
    this_owner,
)
from commitgate.server.ledger.postgres import (
    MIGRATION_LOCK,
    MIGRATIONS,
    SCHEMA_VERSION,
    PostgresLedger,
    migrate,
)
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import Operation, ToolResult

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

T0 = 1_700_000_000.0
ELSEWHERE = "elsewhere:1:aaaa"  # another host: never presumed dead
RESULT = ToolResult([{"type": "text", "text": '{"charge":"ch_1"}'}], {"charge": "ch_1"})

_WAITING_ON_TABLE = (
    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'commitgate_operations'::regclass"
)
_WAITING_ON_ADVISORY = (
    "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'advisory'"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
_LOCK_TABLE = "LOCK TABLE commitgate_operations IN ACCESS EXCLUSIVE MODE"

_MIGRATOR = """
import asyncio, sys
from commitgate.server.ledger.postgres import migrate
print("ready", flush=True)
sys.stdin.readline()
print(asyncio.run(migrate(sys.argv[1])))
"""

_CLAIMER = """
import asyncio, json, sys, time
from commitgate.server.ledger.base import ClaimRequest
from commitgate.server.ledger.postgres import PostgresLedger
from commitgate.server.model.facts import IdempotencyClass

async def main(url, tasks, owner):
    ledger = await PostgresLedger.open(url, min_size=tasks, max_size=tasks)
    request = ClaimRequest("alice", "s1", "k1", "charge", IdempotencyClass.KEY_REQUIRED, "fp-1", "{}", owner, 10.0, 100.0)
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    claims = await asyncio.gather(*(ledger.claim(request, time.time()) for _ in range(tasks)))
    print(json.dumps([[claim.kind.value, claim.operation.operation_id] for claim in claims]))
    await ledger.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""


def request(
    step: str = "k1", *, owner: str = ELSEWHERE, lease: float = 10.0, retention: float = 100.0
) -> ClaimRequest:
    return ClaimRequest(
        principal="alice",
        session="s1",
        step=step,
        tool="charge",
        idempotency_class=IdempotencyClass.KEY_REQUIRED,
        fingerprint="fp-1",
        arguments_json='{"amount":500}',
        owner=owner,
        lease_seconds=lease,
        retention_seconds=retention,
    )


def finish(op: Operation, state: State = State.SUCCEEDED) -> Transition:
    return Transition(
        state, frozenset({State.RUNNING}), OUTCOME_EVENTS[state], expect_fence=op.fence, result=RESULT
    )


async def new_op(ledger: PostgresLedger, step: str, now: float = T0, **kw: Any) -> Operation:
    claim = await ledger.claim(request(step, **kw), now)
    assert claim.kind is ClaimKind.NEW
    return claim.operation


@asynccontextmanager
async def opened(url: str, count: int = 1, **options: Any) -> AsyncIterator[list[PostgresLedger]]:
    """`count` ledgers on one database, each with its own pool: replicas as the database sees them."""
    ledgers = [await PostgresLedger.open(url, **options) for _ in range(count)]
    try:
        yield ledgers
    finally:
        for ledger in ledgers:
            await ledger.close()


async def scalar(url: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


class Gate:
    """Holds `lock_sql` in an open transaction; `open_when(n)` releases it once n waiters are queued."""

    def __init__(self, url: str, lock_sql: str, waiting_sql: str) -> None:
        self.url, self.lock_sql, self.waiting_sql = url, lock_sql, waiting_sql

    async def __aenter__(self) -> Gate:
        self.conn = await asyncpg.connect(self.url)
        self.tx = self.conn.transaction()
        await self.tx.start()
        await self.conn.execute(self.lock_sql)
        self.released = False
        return self

    async def open_when(self, waiters: int) -> None:
        async with asyncio.timeout(30):  # a guard against hanging, not a performance bound
            while await self.conn.fetchval(self.waiting_sql) < waiters:
                await asyncio.sleep(0.01)
        await self.tx.commit()
        self.released = True

    async def __aexit__(self, *exc: object) -> None:
        if not self.released:
            await self.tx.rollback()
        await self.conn.close()


async def spawn(script: str, *args: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    assert (await proc.stdout.readline()).strip() == b"ready"
    return proc


async def go_and_collect(procs: list[asyncio.subprocess.Process]) -> list[str]:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    outputs = [(await proc.communicate())[0].decode() for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * len(procs), outputs
    return outputs


# --- migrations ----------------------------------------------------------------------------


async def test_three_replicas_migrating_at_once_apply_each_migration_once() -> None:
    url = await fresh_url()
    migrators = [await spawn(_MIGRATOR, url) for _ in range(3)]
    async with Gate(url, MIGRATION_LOCK, _WAITING_ON_ADVISORY) as gate:
        collecting = asyncio.ensure_future(go_and_collect(migrators))
        await gate.open_when(3)  # all three are blocked on the migration lock
        applied = sorted(int(out) for out in await collecting)
    assert applied == [0, 0, SCHEMA_VERSION]
    versions = await scalar(url, "SELECT array_agg(version ORDER BY version) FROM commitgate_schema_version")
    assert versions == list(range(1, SCHEMA_VERSION + 1))
    async with opened(url, auto_migrate=False) as (ledger,):
        assert (await new_op(ledger, "k1")).fence == 1


async def test_migrate_is_idempotent_and_a_ledger_can_require_a_current_schema() -> None:
    url = await fresh_url()
    with pytest.raises(LedgerUnavailable, match="commitgate ops migrate"):
        await PostgresLedger.open(url, auto_migrate=False)
    assert await migrate(url) == SCHEMA_VERSION
    assert await migrate(url) == 0
    async with opened(url, auto_migrate=False) as (ledger,):
        assert await ledger.schema_version() == SCHEMA_VERSION


async def test_a_schema_newer_than_this_code_is_refused() -> None:
    url = await fresh_url()
    await migrate(url)
    await scalar(
        url, "INSERT INTO commitgate_schema_version (version) VALUES ($1) RETURNING 1", SCHEMA_VERSION + 1
    )
    for attempt in (migrate(url), PostgresLedger.open(url)):
        with pytest.raises(LedgerUnavailable, match="newer"):
            await attempt


async def test_a_ledger_brought_up_from_any_older_version_is_the_same_as_a_new_one() -> None:
    new = await fresh_url()
    assert await migrate(new) == SCHEMA_VERSION
    expected = await scalar(new, SCHEMA_OBJECTS)
    for older in (1, SCHEMA_VERSION // 2, SCHEMA_VERSION - 1):
        url = await fresh_url()
        conn = await asyncpg.connect(url)
        try:  # version `older`, as a commitgate of that version made it: a statement at a time
            await conn.execute(
                "CREATE TABLE commitgate_schema_version (version integer PRIMARY KEY,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            for version in range(1, older + 1):
                await conn.execute(MIGRATIONS[version - 1])
                await conn.execute("INSERT INTO commitgate_schema_version (version) VALUES ($1)", version)
        finally:
            await conn.close()
        assert await migrate(url) == SCHEMA_VERSION - older
        assert await scalar(url, SCHEMA_OBJECTS) == expected
        versions = await scalar(
            url, "SELECT array_agg(version ORDER BY version) FROM commitgate_schema_version"
        )
        assert versions == list(range(1, SCHEMA_VERSION + 1))


async def test_a_new_ledger_is_made_in_five_round_trips_whatever_the_number_of_migrations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A remote database's latency is paid per round trip, at every first start of a replica."""
    url, sent = await fresh_url(), list[str]()
    for method in ("execute", "fetchval"):
        original = getattr(asyncpg.Connection, method)

        async def counted(
            self: asyncpg.Connection, query: str, *args: Any, _original: Any = original, **kwargs: Any
        ) -> Any:
            sent.append(query)
            return await _original(self, query, *args, **kwargs)

        monkeypatch.setattr(asyncpg.Connection, method, counted)
    assert await migrate(url) == SCHEMA_VERSION
    # BEGIN; the lock and the version table; the version found; every migration; COMMIT
    assert len(sent) == 5, sent


# --- the tests' own ledgers (support/postgres.py) -------------------------------------------


async def test_a_ledger_a_test_gives_back_comes_to_the_next_one_empty() -> None:
    async with private_ledger() as ledger:
        first = ledger.url
        await new_op(ledger, "k1")
    async with private_ledger() as ledger:
        assert ledger.url == first  # the same schema, emptied: the same step is new again
        operation = await new_op(ledger, "k1")
        assert operation.fence == 1
        history = await scalar(ledger.url, "SELECT array_agg(id ORDER BY id) FROM commitgate_audit")
        assert history[0] == 1  # its sequences start again too
        assert await scalar(ledger.url, SCHEMA_OBJECTS) == await scalar(
            await _new_ledger_url(), SCHEMA_OBJECTS
        )


async def test_a_ledger_a_test_changed_is_not_given_to_the_next_one() -> None:
    async with private_ledger() as ledger:
        changed = ledger.url
        await scalar(changed, "ALTER TABLE commitgate_operations DISABLE TRIGGER commitgate_attempt_started")
    async with private_ledger() as ledger:
        assert ledger.url != changed
        async with private_ledger() as inner:  # nor later
            assert inner.url != changed


async def _new_ledger_url() -> str:
    url = await fresh_url()
    await migrate(url)
    return url


# --- claims and fencing across replicas ----------------------------------------------------


async def test_concurrent_claims_from_three_processes_make_exactly_one_owner() -> None:
    url, tasks = await fresh_url(), 6
    claimers = [await spawn(_CLAIMER, url, str(tasks), f"elsewhere:{i}:x") for i in range(3)]
    async with Gate(url, _LOCK_TABLE, _WAITING_ON_TABLE) as gate:
        collecting = asyncio.ensure_future(go_and_collect(claimers))
        await gate.open_when(3 * tasks)  # every claim is queued in PostgreSQL, then all race
        claims = [claim for out in await collecting for claim in json.loads(out)]
    assert len(claims) == 3 * tasks
    assert sorted(kind for kind, _ in claims) == ["existing"] * (3 * tasks - 1) + ["new"]
    assert len({operation_id for _, operation_id in claims}) == 1
    assert await scalar(url, "SELECT count(*) FROM commitgate_operations") == 1
    assert await scalar(url, "SELECT count(*) FROM commitgate_audit WHERE event = 'claimed'") == 1


async def test_concurrent_outcome_writes_with_one_fence_have_exactly_one_winner() -> None:
    url, writers = await fresh_url(), 8
    outcomes = [State.SUCCEEDED, State.FAILED_FINAL] * (writers // 2)
    async with opened(url, 2, min_size=writers // 2, max_size=writers // 2) as replicas:
        op = await new_op(replicas[0], "k1")
        async with Gate(url, _LOCK_TABLE, _WAITING_ON_TABLE) as gate:
            writes = asyncio.gather(
                *(
                    replicas[i % 2].update(op.operation_id, finish(op, state), T0 + 1)
                    for i, state in enumerate(outcomes)
                )
            )
            await gate.open_when(writers)
            winners = [written for written in await writes if written is not None]
        assert len(winners) == 1
        assert (await replicas[1].get_by_id(None, op.operation_id)).state is winners[0].state  # type: ignore[union-attr]
        events = [entry.event for entry in await replicas[1].history(op.operation_id)]
        assert events == ["claimed", winners[0].state.value.lower()]


async def test_a_stale_owner_cannot_record_after_another_replica_retook_the_operation() -> None:
    url = await fresh_url()
    async with opened(url, 2) as (first, second):
        stale = await new_op(first, "k1")
        retryable = Transition(
            State.FAILED_RETRYABLE, frozenset({State.RUNNING}), AuditEvent.RETRIES_EXHAUSTED, expect_fence=1
        )
        assert await first.update(stale.operation_id, retryable, T0 + 1) is not None
        retake = await second.claim(request("k1", owner="elsewhere:2:bbbb"), T0 + 2)
        assert retake.kind is ClaimKind.NEW and (retake.operation.fence, retake.operation.attempts) == (2, 2)
        assert await first.update(stale.operation_id, finish(stale), T0 + 3) is None
        assert await first.renew_lease(stale.operation_id, stale.fence, Lease(ELSEWHERE, T0 + 100)) is False
        done = await second.update(retake.operation.operation_id, finish(retake.operation), T0 + 4)
        assert done is not None and done.state is State.SUCCEEDED and done.fence == 2
        assert [(e.event, e.fence) for e in await first.history(stale.operation_id)] == [
            ("claimed", 1),
            (AuditEvent.RETRIES_EXHAUSTED, 1),
            ("retry_claimed", 2),
            ("succeeded", 2),
        ]


# --- sweeps with several replicas ------------------------------------------------------------


async def test_several_replicas_sweeping_at_once_move_each_expired_lease_once() -> None:
    url = await fresh_url()
    async with opened(url, 3) as ledgers:
        expired = {(await new_op(ledgers[0], f"k{i}", lease=1.0)).operation_id for i in range(12)}
        alive = await new_op(ledgers[0], "alive", lease=1000.0)
        async with Gate(url, _LOCK_TABLE, _WAITING_ON_TABLE) as gate:
            sweeps = asyncio.gather(*(ledger.expire_leases(T0 + 5) for ledger in ledgers))
            await gate.open_when(3)
            moved = [op.operation_id for ops in await sweeps for op in ops]
        assert sorted(moved) == sorted(expired)  # each exactly once, by one replica or another
        assert await scalar(url, "SELECT count(*) FROM commitgate_audit WHERE event = 'lease_expired'") == 12
        assert (await ledgers[1].get_by_id(None, alive.operation_id)).state is State.RUNNING  # type: ignore[union-attr]


async def test_a_sweep_expires_a_dead_owner_on_this_host_before_its_lease_runs_out() -> None:
    url = await fresh_url()
    finished = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await finished.wait()
    dead = f"{socket.gethostname()}:{finished.pid}:deadbeef"
    async with opened(url) as (ledger,):
        gone = await new_op(ledger, "gone", owner=dead, lease=1000.0)
        mine = await new_op(ledger, "mine", owner=this_owner(), lease=1000.0)
        far = await new_op(ledger, "far", owner=f"elsewhere:{finished.pid}:deadbeef", lease=1000.0)
        moved = await ledger.expire_leases(T0 + 1)
        assert [op.operation_id for op in moved] == [gone.operation_id]
        assert (
            moved[0].state is State.UNKNOWN
            and moved[0].error is not None
            and moved[0].error.code == "lease_expired"
        )
        for op in (mine, far):
            assert (await ledger.get_by_id(None, op.operation_id)).state is State.RUNNING  # type: ignore[union-attr]


async def test_purge_deletes_in_small_batches_and_never_unknown_or_running() -> None:
    url = await fresh_url()
    async with opened(url) as (ledger,):
        for i in range(25):
            op = await new_op(ledger, f"done{i}", retention=10.0)
            await ledger.update(op.operation_id, finish(op), T0 + 1)
        await new_op(ledger, "unknown", lease=1.0)
        assert len(await ledger.expire_leases(T0 + 5)) == 1
        await new_op(ledger, "running", lease=1e9)
        assert await ledger.purge(T0 + 100, batch=10) == 25
        counts = await ledger.counts()
        assert (counts.states["SUCCEEDED"], counts.states["UNKNOWN"], counts.states["RUNNING"]) == (0, 1, 1)
        assert await ledger.purge(T0 + 1e10) == 0
        events = await scalar(url, "SELECT array_agg(event ORDER BY id) FROM commitgate_audit")
        assert events == ["claimed", "lease_expired", "claimed"]  # the purged records took theirs along


async def test_purge_skips_a_row_in_use_instead_of_waiting_for_it() -> None:
    url = await fresh_url()
    async with opened(url) as (ledger,):
        busy, free = [await new_op(ledger, step, retention=10.0) for step in ("busy", "free")]
        for op in (busy, free):
            await ledger.update(op.operation_id, finish(op), T0 + 1)
        holder = await asyncpg.connect(url)
        try:
            async with holder.transaction():
                await holder.execute(
                    "SELECT 1 FROM commitgate_operations WHERE operation_id = $1 FOR UPDATE",
                    busy.operation_id,
                )
                assert await asyncio.wait_for(ledger.purge(T0 + 100), 30) == 1  # guard, not a timing claim
        finally:
            await holder.close()
        assert await ledger.get_by_id(None, busy.operation_id) is not None
        assert await ledger.purge(T0 + 100) == 1
        assert await ledger.get_by_id(None, busy.operation_id) is None


# --- failing closed ---------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_database_is_unavailable_and_the_password_never_shows() -> None:
    url = f"postgresql://commitgate:s3cret@127.0.0.1:{closed_port()}/ledger"
    for attempt in (open_ledger(url), migrate(url), PostgresLedger.open(url)):
        with pytest.raises(LedgerUnavailable) as caught:
            await attempt
        assert "s3cret" not in str(caught.value) and "***" in str(caught.value)


async def test_a_connection_lost_mid_claim_fails_closed_and_the_next_claim_recovers() -> None:
    url = await fresh_url()
    name = "victim_" + uuid.uuid4().hex[:8]
    async with opened(f"{url}&application_name={name}", min_size=1, max_size=1) as (ledger,):
        async with Gate(url, _LOCK_TABLE, _WAITING_ON_TABLE) as gate:
            claiming = asyncio.ensure_future(ledger.claim(request("k1"), T0))
            async with asyncio.timeout(30):
                while await gate.conn.fetchval(_WAITING_ON_TABLE) < 1:
                    await asyncio.sleep(0.01)
            await gate.conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", name
            )
            with pytest.raises(LedgerUnavailable):
                await claiming
        claim = await ledger.claim(request("k1"), T0 + 1)
        assert claim.kind is ClaimKind.NEW  # the lost claim recorded nothing
        assert [e.event for e in await ledger.history(claim.operation.operation_id)] == ["claimed"]


async def test_a_read_only_database_fails_the_writable_check_and_every_claim() -> None:
    url = await fresh_url()
    await migrate(url)
    async with opened(f"{url}&default_transaction_read_only=on", auto_migrate=False) as (ledger,):
        with pytest.raises(LedgerUnavailable, match="read-only"):
            await ledger.check_writable()
        with pytest.raises(LedgerUnavailable, match="read-only"):
            await ledger.claim(request("k1"), T0)
    assert await scalar(url, "SELECT count(*) FROM commitgate_operations") == 0


# --- the benchmark ----------------------------------------------------------------------------


async def test_replica_benchmark_runs_and_cleans_up_after_itself() -> None:
    url = await fresh_url()
    figures = await run_pg_bench(url, tasks=4, seconds=0.3, replicas=[2])
    (run,) = figures["runs"]
    assert (run["replicas"], run["tasks"]) == (2, 4)
    assert run["ops"] > 0 and run["ops_per_s"] > 0 and 0 < run["median_us"] <= run["p99_us"]
    assert figures["server"]["synchronous_commit"] in ("on", "remote_apply", "remote_write", "local", "off")
    leftover = await scalar(url, "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'commitgate_bench_%'")
    assert leftover == 0
