"""Several replicas on one PostgreSQL ledger: real `commitgate serve` processes over stateless streamable HTTP.

Three replicas start together against an empty schema (they race for the
migrations), then take 64 concurrent duplicates of one charge spread
round-robin across them; a fourth replica is killed with SIGKILL mid-charge
and the others reconcile and replay its operation. Effects are counted in the
sandbox store all replicas write to (`COMMITGATE_SANDBOX`). `commitgate ops
migrate` runs through the real CLI.

Skipped with the reason when PostgreSQL is not reachable; under CI=true that
fails instead (see support/postgres.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx2
import pytest
from support import postgres as pg_support
from support.http_servers import RoundRobin, Served, connect, error_code, operation_of
from support.replicas import charge_of, cli, ports, replica, replicas, with_password, write_replica_policy

from commitgate.server.demo import tools as demo
from commitgate.server.ledger import LedgerUnavailable
from commitgate.server.ledger.postgres import SCHEMA_VERSION, PostgresLedger
from commitgate.server.policy.loading import load_policy
from commitgate.server.serve.gateway import Gateway

pytestmark = pytest.mark.slow

DUPLICATES = 64
CLIENTS = 4  # each with its own round-robin balancer over the 3 replicas, half of them per protocol era
PASSWORD_ENV = "CG_TEST_PG_PASSWORD"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="module")
def ledger_url() -> str:
    """One empty schema shared by every replica of this module."""
    return asyncio.run(pg_support.fresh_url())


@pytest.fixture(scope="module")
def trio(workdir: Path, ledger_url: str) -> Iterator[list[Served]]:
    """Three replicas launched at the same moment against the empty schema."""
    policy = write_replica_policy(workdir, "replicas.toml")
    slow_charge = {"COMMITGATE_SANDBOX_FAULTS": "charge_card.latency=0.5s"}  # duplicates overlap the first
    with replicas(workdir, policy, ledger_url, workdir / "sandbox.db", 3, slow_charge) as started:
        yield started


@pytest.fixture(autouse=True)
def sandbox(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point `demo.count` at the store the replicas of this module write to."""
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(workdir / "sandbox.db"))
    return workdir / "sandbox.db"


def new_key() -> str:
    return f"k-{uuid.uuid4().hex[:16]}"


def charge(key: str) -> dict[str, Any]:
    return {"card": "4242", "amount_cents": 700, "description": key, "idempotency_key": key}


async def fetch(url: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        rows: list[asyncpg.Record] = await conn.fetch(sql)
        return rows
    finally:
        await conn.close()


async def status_of(served: Served, key: str) -> dict[str, Any]:
    async with connect(served, "alice") as client:
        status = await client.call_tool("get_operation_status", {"idempotency_key": key})
    assert not status.is_error, status
    return dict(status.structured_content["operation"])


# --- migrations ------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.postgres
async def test_three_replicas_starting_together_apply_each_migration_once(
    trio: list[Served], ledger_url: str
) -> None:
    rows = await fetch(ledger_url, "SELECT version FROM commitgate_schema_version ORDER BY version")
    assert [r["version"] for r in rows] == list(range(1, SCHEMA_VERSION + 1))
    for served in trio:
        assert served.proc.poll() is None, served.stderr()[-2000:]
        health = httpx2.get(served.base + "/healthz", timeout=5)
        assert (health.status_code, health.json()) == (200, {"status": "ok", "ledger": "writable"})


async def new_schema_url() -> tuple[str, str]:
    """A URL of an empty schema with a password in it (trust auth ignores it), and that password."""
    return with_password(await pg_support.fresh_url(), "s3cret-" + uuid.uuid4().hex[:8])


@pytest.mark.anyio
@pytest.mark.postgres
async def test_ops_migrate_applies_pending_migrations_once_and_never_prints_the_password(
    tmp_path: Path,
) -> None:
    url, password = await new_schema_url()
    first = cli("ops", "migrate", "--ledger", url)
    assert first.returncode == 0, first.stderr
    assert f"applied {SCHEMA_VERSION} migration(s); schema version {SCHEMA_VERSION}" in first.stdout
    assert password not in first.stdout + first.stderr

    # Again, the URL from a policy with the password in an environment variable: nothing left to do.
    in_policy = url.replace(f":{password}@", f":${{{PASSWORD_ENV}}}@")
    assert password not in in_policy
    policy = write_replica_policy(tmp_path, "policy.toml", ledger_url=in_policy)
    env = {**os.environ, PASSWORD_ENV: password}
    again = cli("ops", "migrate", "--policy", str(policy), "--json", env=env)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["applied"] == 0
    assert report["schema_version"] == SCHEMA_VERSION
    assert ":***@" in report["ledger"]
    assert password not in again.stdout + again.stderr
    rows = await fetch(url, "SELECT version FROM commitgate_schema_version ORDER BY version")
    assert [r["version"] for r in rows] == list(range(1, SCHEMA_VERSION + 1))


@pytest.mark.anyio
@pytest.mark.postgres
async def test_with_auto_migrate_off_a_replica_refuses_an_unmigrated_ledger_until_ops_migrate(
    tmp_path: Path,
) -> None:
    url, _ = await new_schema_url()
    policy = load_policy(write_replica_policy(tmp_path, "policy.toml", auto_migrate=False, ledger_url=url))
    with pytest.raises(LedgerUnavailable, match="commitgate ops migrate"):
        await Gateway.open(policy)
    rows = await fetch(url, "SELECT to_regclass('commitgate_operations') IS NULL AS untouched")
    assert rows[0]["untouched"], "auto_migrate = false must not create the schema"

    migrated = cli("ops", "migrate", "--ledger", url)
    assert migrated.returncode == 0, migrated.stderr
    gateway = await Gateway.open(policy)
    try:
        await gateway.ledger.check_writable()
    finally:
        await gateway.close()


def test_ops_migrate_on_sqlite_says_it_migrates_itself(tmp_path: Path) -> None:
    result = cli("ops", "migrate", "--ledger", f"sqlite:///{tmp_path / 'ledger.db'}")
    assert result.returncode == 0, result.stderr
    assert "migrates its schema itself when it is opened" in result.stdout
    assert not (tmp_path / "ledger.db").exists()  # nothing to migrate, so nothing is created


# --- duplicates across replicas -----------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.postgres
async def test_64_concurrent_duplicates_across_three_replicas_charge_once(trio: list[Served]) -> None:
    key = new_key()
    results: list[Any] = []
    balancers = [RoundRobin(ports(trio[i % 3 :] + trio[: i % 3])) for i in range(CLIENTS)]

    async def one_client(balancer: RoundRobin, mode: str) -> None:
        async with (
            connect(trio[0], "alice", mode, transport=balancer) as client,
            anyio.create_task_group() as tg,
        ):
            for _ in range(DUPLICATES // CLIENTS):
                tg.start_soon(call, client)

    async def call(client: Any) -> None:
        results.append(await client.call_tool("charge_card", charge(key)))

    async with anyio.create_task_group() as tg:
        for i, balancer in enumerate(balancers):
            tg.start_soon(one_client, balancer, "legacy" if i % 2 else "auto")

    assert len(results) == DUPLICATES
    for balancer in balancers:
        assert set(balancer.sent) == set(ports(trio))
    answered = [r for r in results if error_code(r) != "operation_in_progress"]
    charges = {charge_of(r) for r in answered}
    if len(answered) < len(results):  # a duplicate that waited past in_progress_wait: the poll tells
        operation = await status_of(trio[1], key)
        assert operation["state"] == "SUCCEEDED"
        charges.add(operation["result"]["structuredContent"]["charge_id"])
    assert len(charges) == 1
    assert len({operation_of(r)["operation_id"] for r in answered}) == 1
    owners = sum(not operation_of(r)["replayed"] for r in answered)  # the owner's own answer
    # ... unless the owner itself outlived respond_within on a loaded machine (told to poll, as above)
    assert owners == 1 if len(answered) == len(results) else owners <= 1
    assert demo.count("charges", idempotency_key=key) == 1
    assert [row["id"] for row in demo.rows("charges", idempotency_key=key)] == sorted(charges)


# --- a replica killed mid-operation --------------------------------------------------------------


async def wait_for_charge(key: str, owner: Served) -> None:
    with anyio.fail_after(20):
        while demo.count("charges", idempotency_key=key) == 0:
            assert owner.proc.poll() is None, owner.stderr()[-2000:]
            await anyio.sleep(0.02)


async def call_until_killed(served: Served, key: str) -> None:
    with contextlib.suppress(Exception):  # the server dies under this call: no answer comes
        async with connect(served, "alice") as client:
            await client.call_tool("charge_card", charge(key))


@pytest.mark.anyio
@pytest.mark.postgres
async def test_a_replica_killed_mid_charge_is_reconciled_by_another_and_replayed_by_a_third(
    trio: list[Served], workdir: Path, ledger_url: str, sandbox: Path
) -> None:
    policy = write_replica_policy(workdir, "doomed.toml", lease="1s")
    hang = {"COMMITGATE_SANDBOX_FAULTS": "charge_card.timeout_after_effect=30s"}  # charged, then no answer
    key = new_key()
    with replica(workdir, policy, ledger_url, sandbox, hang) as doomed:
        async with anyio.create_task_group() as tg:
            tg.start_soon(call_until_killed, doomed, key)
            await wait_for_charge(key, doomed)  # the effect is committed; the operation is RUNNING
            assert doomed.stop(signal.SIGKILL) == -signal.SIGKILL
            tg.cancel_scope.cancel()

    operation = await status_of(trio[1], key)  # owner gone: UNKNOWN, then the status check finds the charge
    (made,) = demo.rows("charges", idempotency_key=key)
    assert operation["state"] == "SUCCEEDED", operation
    assert operation["result"]["structuredContent"]["charge_id"] == made["id"]
    assert operation["reconciliation"]["by"] == "status_check"

    async with connect(trio[2], "alice", "legacy") as client:
        retry = await client.call_tool("charge_card", charge(key))
    assert charge_of(retry) == made["id"]
    assert operation_of(retry)["replayed"] is True
    assert demo.count("charges", idempotency_key=key) == 1

    ledger = await PostgresLedger.open(ledger_url, min_size=1, max_size=1, auto_migrate=False)
    try:
        events = [entry.event for entry in await ledger.history(operation["operation_id"])]
    finally:
        await ledger.close()
    assert events == ["claimed", "lease_expired", "reconciled_found"]
