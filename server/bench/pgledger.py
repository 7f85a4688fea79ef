"""Throughput of the PostgreSQL ledger with several replicas (a benchmark, not a timed test).

    python -m commitgate.server.bench.pgledger URL [--tasks 64] [--seconds 5] [--replicas 1 2 3] [--json]

Each replica is a separate process with its own pool, as separate commitgate
servers would be; the `tasks` concurrent clients are spread across them. Every
client loops over a durable claim + complete (the two ledger writes of a
first-time guarded call) on fresh keys until the time is up. The run uses a
schema of its own in URL's database and drops it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.parse
import uuid
from typing import Any

import asyncpg

from commitgate.server.ledger.base import ClaimKind, ClaimRequest, Transition
from commitgate.server.ledger.postgres import PostgresLedger, migrate, redact
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import ToolResult

_RESULT = ToolResult([{"type": "text", "text": '{"ok":true}'}], {"ok": True})
_ARGUMENTS = '{"amount_cents":500,"card":"4242"}'


def _with_schema(url: str, schema: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query["search_path"] = schema
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


async def _claim_and_complete(ledger: PostgresLedger, session: str, step: str, owner: str) -> None:
    request = ClaimRequest(
        "bench",
        session,
        step,
        "charge_card",
        IdempotencyClass.KEY_REQUIRED,
        "f" * 64,
        _ARGUMENTS,
        owner,
        30.0,
        86400.0,
    )
    claim = await ledger.claim(request, time.time())
    if claim.kind is not ClaimKind.NEW:
        raise RuntimeError(f"benchmark key {step!r} was not new: {claim.kind}")
    done = Transition(
        State.SUCCEEDED, frozenset({State.RUNNING}), AuditEvent.SUCCEEDED, expect_fence=1, result=_RESULT
    )
    if await ledger.update(claim.operation.operation_id, done, time.time()) is None:
        raise RuntimeError(f"could not record the outcome of {step!r}")


async def _worker(url: str, tasks: int, seconds: float, pool: int) -> dict[str, Any]:
    """One replica: `tasks` clients sharing a pool of `pool` connections, started when the coordinator says go."""
    size = max(1, min(tasks, pool))
    ledger = await PostgresLedger.open(url, min_size=size, max_size=size, auto_migrate=False)
    replica = uuid.uuid4().hex[:8]
    samples: list[float] = []
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    deadline = time.perf_counter() + seconds

    async def client(t: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await _claim_and_complete(ledger, f"{replica}-{t}", f"k{i}", f"bench:{replica}:{t}")
            samples.append(time.perf_counter() - start)
            i += 1

    start = time.perf_counter()
    await asyncio.gather(*(client(t) for t in range(tasks)))
    elapsed = time.perf_counter() - start
    await ledger.close()
    return {"elapsed": elapsed, "samples": samples}


async def _run_replicas(url: str, tasks: int, seconds: float, replicas: int, pool: int) -> dict[str, Any]:
    shares = [tasks // replicas + (1 if r < tasks % replicas else 0) for r in range(replicas)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "commitgate.server.bench.pgledger",
            "--worker",
            url,
            "--tasks",
            str(share),
            "--seconds",
            str(seconds),
            "--pool",
            str(pool),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for share in shares
        if share > 0
    ]
    for proc in procs:  # every replica has its pool open before anyone starts
        assert proc.stdout is not None
        if (await proc.stdout.readline()).strip() != b"ready":
            raise RuntimeError("a benchmark replica failed to start")
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    outputs = [json.loads((await proc.communicate())[0]) for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError("a benchmark replica failed")
    samples = sorted(s for out in outputs for s in out["samples"])
    elapsed = max(out["elapsed"] for out in outputs)
    return {
        "replicas": len(procs),
        "tasks": tasks,
        "pool_per_replica": pool,
        "ops": len(samples),
        "seconds": round(elapsed, 3),
        "ops_per_s": round(len(samples) / elapsed, 1),
        "median_us": round(statistics.median(samples) * 1e6, 1),
        "p99_us": round(samples[min(len(samples) - 1, int(0.99 * len(samples)))] * 1e6, 1),
    }


async def _server_settings(url: str) -> dict[str, str]:
    conn = await asyncpg.connect(url)
    try:
        names = ("server_version", "synchronous_commit", "fsync", "wal_sync_method")
        return {name: await conn.fetchval(f"SHOW {name}") for name in names}
    finally:
        await conn.close()


async def run_pg_bench(
    url: str, *, tasks: int = 64, seconds: float = 5.0, replicas: int | list[int] = 1, pool: int = 16
) -> dict[str, Any]:
    """Durable claim + complete throughput with `tasks` clients over each replica count; ops/s and p99.

    Each replica has a pool of `pool` connections, the PostgresLedger default.
    """
    counts = [replicas] if isinstance(replicas, int) else list(replicas)
    schema = "commitgate_bench_" + uuid.uuid4().hex[:8]
    admin = await asyncpg.connect(url)
    try:
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        bench_url = _with_schema(url, schema)
        await migrate(bench_url)
        figures: dict[str, Any] = {"ledger": redact(url), "server": await _server_settings(url), "runs": []}
        for count in counts:
            figures["runs"].append(await _run_replicas(bench_url, tasks, seconds, count, pool))
        return figures
    finally:
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commitgate.server.bench.pgledger", description=__doc__)
    parser.add_argument(
        "url", help="postgresql://... (a schema is created in its database and dropped after)"
    )
    parser.add_argument("--tasks", type=int, default=64, help="concurrent clients in all")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each run")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3], help="replica counts to run")
    parser.add_argument("--pool", type=int, default=16, help="connections per replica")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        json.dump(asyncio.run(_worker(args.url, args.tasks, args.seconds, args.pool)), sys.stdout)
        return 0
    figures = asyncio.run(
        run_pg_bench(args.url, tasks=args.tasks, seconds=args.seconds, replicas=args.replicas, pool=args.pool)
    )
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
        return 0
    server = figures["server"]
    print(
        f"ledger: {figures['ledger']} (PostgreSQL {server['server_version']}, synchronous_commit={server['synchronous_commit']})"
    )
    for run in figures["runs"]:
        print(
            f"{run['replicas']} replica(s) x {run['pool_per_replica']} connections, {run['tasks']} clients:"
            f" {run['ops_per_s']:>9} claim+complete/s"
            f"   median {run['median_us']:>8} µs   p99 {run['p99_us']:>8} µs"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
