"""Memory, ledger size and start-up time: the `memory` section of `commitgate bench`.

A server's resident memory with an empty ledger and with one of a million rows (built in bulk,
shaped like real operations), the ledger's bytes per operation, and the time from spawning a
server to its first tools/list answer, beside a plain SDK server's.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import StdioServerParameters

from commitgate.server.bench.overhead import OVERHEAD_POLICY
from commitgate.server.bench.stats import spread
from commitgate.server.bench.workspace import Bench, proc_status_kib


async def memory(bench: Bench) -> dict[str, Any]:
    scale = bench.scale
    tick = bench.task("memory + start-up", 3 + 3 * scale.startups)
    big = bench.ledger("million")
    started = time.perf_counter()
    await build_ledger(big, scale.memory_rows)
    build_s = time.perf_counter() - started
    tick(1)
    policy = bench.policy("overhead", OVERHEAD_POLICY)
    empty = bench.ledger("empty")
    servers = {
        "commitgate_empty_ledger": bench.serve(policy, empty),
        "commitgate_big_ledger": bench.serve(policy, big),
        "plain_sdk": bench.plain(),
    }
    rss = {"empty_ledger": await _resident(bench, servers["commitgate_empty_ledger"], empty)}
    tick(1)
    rss["big_ledger"] = await _resident(bench, servers["commitgate_big_ledger"], big)
    tick(1)
    startup: dict[str, list[float]] = {name: [] for name in servers}
    for _ in range(scale.startups):
        for name, params in servers.items():
            startup[name].append(await _startup(bench, params))
            tick(1)
    return {
        "ledger_rows": scale.memory_rows,
        "ledger_build_s": round(build_s, 1),
        "ledger_file_bytes": big.stat().st_size,
        "ledger_bytes_per_operation": round(big.stat().st_size / scale.memory_rows, 1),
        "rss_kib": rss,
        "startup_ms": {name: spread([s * 1000 for s in values], 1) for name, values in startup.items()},
    }


async def _resident(bench: Bench, params: StdioServerParameters, ledger: Path) -> dict[str, int | None]:
    """RSS of a serving process after a few calls of each kind (a claim, a replay, a listing)."""
    async with bench.connect(params) as client:
        await client.list_tools()
        for _ in range(2):
            await client.call_tool("noop_keyed", {"n": 1, "idempotency_key": "memory-probe"})
        await client.call_tool("noop", {"n": 1})
        await client.call_tool("list_operations", {"limit": 50})
        pid = bench.server_pid(ledger)
        return {"vm_rss": proc_status_kib(pid, "VmRSS"), "vm_hwm": proc_status_kib(pid, "VmHWM")}


async def _startup(bench: Bench, params: StdioServerParameters) -> float:
    """Spawn -> first tools/list answer, as a client like Claude Desktop sees it."""
    started = time.perf_counter()
    async with bench.connect(params) as client:
        await client.list_tools()
        return time.perf_counter() - started


async def build_ledger(path: Path, rows: int) -> None:
    """A ledger file with `rows` realistic SUCCEEDED operations (two audit events each), built in bulk."""
    from commitgate.server.ledger.sqlite import SQLiteLedger

    ledger = await SQLiteLedger.open(path)  # the real schema, by the real migrations
    await ledger.close()
    await anyio.to_thread.run_sync(_bulk_insert, path, rows)


_BULK_OPERATIONS = """
WITH RECURSIVE seq(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM seq WHERE x < :rows)
INSERT INTO operations (operation_id, principal, session, step, tool, idempotency_class, fingerprint, state,
    attempts, fence, arguments, result, retention, created_at, updated_at, completed_at, expires_at)
SELECT 'op_' || lower(hex(randomblob(16))), 'bench', 'session-' || (x / 20), 'order-' || x || '-charge',
    'charge_card', 'key-and-status-check', lower(hex(randomblob(32))), 'SUCCEEDED', 1, 1,
    '{"amount_cents":' || (100 + x % 9000) || ',"card":"4242424242424242","description":"order ' || x || '"}',
    '{"content":[{"type":"text","text":"{\\"amount_cents\\":' || (100 + x % 9000)
        || ',\\"card\\":\\"4242424242424242\\",\\"charge_id\\":\\"' || printf('ch_%024d', x)
        || '\\",\\"status\\":\\"succeeded\\"}"}],"structuredContent":{"amount_cents":' || (100 + x % 9000)
        || ',"card":"4242424242424242","charge_id":"' || printf('ch_%024d', x) || '","status":"succeeded"}}',
    86400.0, :now - (:rows - x) * 0.01, :now - (:rows - x) * 0.01 + 0.004,
    :now - (:rows - x) * 0.01 + 0.004, :now - (:rows - x) * 0.01 + 86400.004
FROM seq
"""
# Both entries of each operation, in the audit trail's key order (real operation ids grow with time, so
# a real ledger's entries arrive nearly in this order too).
_BULK_AUDIT = """
INSERT INTO audit (operation_id, id, at, event, from_state, to_state, fence, actor)
SELECT operation_id, entry.id, created_at + entry.after, entry.event, entry.from_state, entry.to_state, 1,
    'bench-host:4242:0a1b2c3d'
FROM operations, (SELECT 1 AS id, 0.0 AS after, 'claimed' AS event, NULL AS from_state, 'RUNNING' AS to_state
    UNION ALL SELECT 2, 0.004, 'succeeded', 'RUNNING', 'SUCCEEDED') AS entry
ORDER BY operation_id, entry.id
"""


def _bulk_insert(path: Path, rows: int) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = DELETE")  # one big transaction: no WAL growth, no fsyncs
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -200000")
        conn.execute("BEGIN")
        conn.execute(_BULK_OPERATIONS, {"rows": rows, "now": time.time()})
        conn.execute(_BULK_AUDIT)
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode = WAL")  # as the ledger keeps it
    finally:
        conn.close()
