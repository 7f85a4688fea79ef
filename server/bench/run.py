"""`commitgate bench`: the safety experiments and the cost benchmark, through real processes.

Every experiment drives real `commitgate serve` processes over stdio with the
SDK's `Client`, and counts effects in the system of record (the demo sandbox
store, a SQLite file), never in commitgate's own answers:

  1. double charge: bookings with 50 % of acknowledgements lost after commit; a
     naive client (no key, pass-through policy, retries until it sees success)
     vs the same agent through commitgate;
  2. saga: reserve -> pay -> confirm with 30 % confirmation failures, undone by
     compensate_session (sent twice at once, then again, with refund acks lost);
  3. backoff: concurrent retriers against a capacity-limited service, retried by
     commitgate's safe-retry class with immediate retries vs full jitter;
  4. concurrency: concurrent duplicates of each key through one server process
     and through several processes sharing one ledger file;
  5. fresh keys: bookings with 50 % of answers lost before the client reads them,
     by a naive client that mints a new key on every try, with duplicate
     detection off and on (the default).

The overhead suite runs its variants side by side: calls are interleaved one by
one (in a fresh random order each time), grouped in rounds; each round gives a median per variant
and a paired ratio, and the summary is the median ratio with its spread. Beside
the compared variants (on the default, lean stdio transport of fast_stdio.py) it
measures the guarded call without fsyncs (what the guard costs in software), the
same server on the SDK's stdio transport, what duplicate detection adds (the same
guarded no-op with `duplicates = false`), the guarded call with `[ledger] durability
= "claim"` (the outcome synced by the next group commit), what one durable SQLite commit
costs in syncs on this disk, and, timed in the same rounds, the disk floor: a 4 KiB
overwrite of a preallocated file + fdatasync. The guard's cost is reported in units of
two such syncs, what a claim and an outcome need at the least.
Then the ledger alone (its throughput), memory with a million ledger rows, ledger bytes per
operation and start-up time.

    commitgate bench [--quick] [--json FILE] [--plot FILE.png] [--only SECTION,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

import anyio
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import CallToolResult, RequestParamsMeta
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from commitgate.server.demo.sandbox import server_pids
from commitgate.server.model.facts import OPERATION_META, SESSION_META

SECTIONS = (
    "double_charge",
    "saga",
    "backoff",
    "concurrency",
    "fresh_keys",
    "overhead",
    "ledger",
    "memory",
    "tracing",
)


class BenchError(Exception):
    """Something the benchmark relies on did not happen (a crashed server, an unexpected answer)."""


@dataclass(frozen=True, slots=True)
class Scale:
    bookings: int = 1000
    agents: int = 8  # concurrent agents in experiments 1 and 2
    orders: int = 300
    retriers: int = 100
    capacity: int = 10
    median_ms: float = 200.0
    p99_ms: float = 2000.0
    dup_keys: int = 100
    dup_copies: int = 64
    processes: int = 4
    keys_in_flight: int = 2
    tool_latency: float = 0.05  # how long the duplicated effect takes, so duplicates really overlap
    rounds: int = 12
    calls_per_round: int = 200
    ledger_ops: int = 10_000
    memory_rows: int = 1_000_000
    startups: int = 7


FULL = Scale()
QUICK = Scale(
    bookings=60,
    orders=30,
    retriers=20,
    capacity=4,
    median_ms=50.0,
    p99_ms=500.0,
    dup_keys=8,
    dup_copies=16,
    processes=2,
    tool_latency=0.02,
    rounds=4,
    calls_per_round=40,
    ledger_ops=1000,
    memory_rows=100_000,
    startups=2,
)

# --- policies -------------------------------------------------------------------------------------

OVERHEAD_POLICY = """
# The same no-op twice: unguarded (safe-retry, no ledger) and guarded (key-required, durable ledger).
[server]
name = "commitgate-bench"
[ledger]
synchronous = "FULL"
[tools.noop]
class = "safe-retry"
python = "commitgate.tools.benchtools:noop"
retry = { attempts = 1 }
[tools.noop_keyed]
class = "key-required"
python = "commitgate.tools.benchtools:noop"
retry = { attempts = 1 }
[tools.noop_keyed_unchecked]
class = "key-required"
python = "commitgate.tools.benchtools:noop"
retry = { attempts = 1 }
duplicates = false
"""

BACKOFF_POLICY = """
[server]
name = "commitgate-bench-backoff"
[ledger]
synchronous = "FULL"
[tools.work]
class = "safe-retry"
python = "commitgate.tools.benchtools:overloaded_service"
timeout = "60s"
retry = {retry}
[tools.service_load]
class = "safe-retry"
python = "commitgate.tools.benchtools:service_load"
retry = {{ attempts = 1 }}
"""
IMMEDIATE_RETRY = (
    '{ attempts = 100, initial = "0ms", max = "0ms", multiplier = 1.0, jitter = "none", deadline = "300s" }'
)
JITTER_RETRY = (
    '{ attempts = 100, initial = "100ms", max = "2s", multiplier = 2.0, jitter = "full", deadline = "300s" }'
)

CONCURRENCY_POLICY = """
[server]
name = "commitgate-bench-concurrency"
in_progress_wait = "60s"
respond_within = "60s"
[ledger]
synchronous = "FULL"
[tools.create_ticket]
class = "key-required"
python = "commitgate.tools.demo:create_ticket"
timeout = "60s"
"""

# --- small helpers ----------------------------------------------------------------------------------


def session_meta(session: str) -> RequestParamsMeta:
    """The request `_meta` that names commitgate's session (an open map in the SDK's types)."""
    return cast(RequestParamsMeta, {SESSION_META: session})


def operation_of(result: CallToolResult) -> dict[str, Any]:
    return dict((result.meta or {}).get(OPERATION_META) or {})


def error_code(result: CallToolResult) -> str | None:
    if not result.is_error:
        return None
    return str((result.structured_content or {}).get("error", {}).get("code"))


def quantile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: list[float], digits: int = 3) -> dict[str, float]:
    """Median with the interquartile range and the extremes: how much a figure moved between rounds."""
    return {
        "median": round(statistics.median(values), digits),
        "p25": round(quantile(values, 0.25), digits),
        "p75": round(quantile(values, 0.75), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


async def pool(count: int, workers: int, job: Callable[[int], Awaitable[None]]) -> None:
    """Run job(0..count-1) on `workers` concurrent tasks."""
    items = iter(range(count))

    async def worker() -> None:
        for index in items:  # one shared iterator: each index is taken exactly once
            await job(index)

    async with anyio.create_task_group() as group:
        for _ in range(min(workers, count)):
            group.start_soon(worker)


def proc_status_kib(pid: int, field_name: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return None


def cpu_seconds(pid: int) -> float | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def commit_sync_us(directory: Path, samples: int = 400, warm_up: int = 100) -> float:
    """What durability adds to one SQLite commit in `directory`: synchronous=FULL minus NORMAL.

    Two WAL databases shaped like the ledger (a row, a unique index, a second index),
    committed in turn so that both see the same disk; the difference of the median
    commits is the sync a durable claim or outcome waits for. Two per guarded call
    bound the guarded call's cost from below whatever the software does. The warm-up commits grow the WAL;
    later ones reuse it, as a ledger's do.
    """
    timings: dict[str, list[float]] = {"FULL": [], "NORMAL": []}
    conns: dict[str, sqlite3.Connection] = {}
    try:
        for mode in timings:
            path = directory / f".commit-probe-{mode}-{uuid.uuid4().hex}.db"
            conn = conns[mode] = sqlite3.connect(path, isolation_level=None)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {mode}")
            conn.execute("CREATE TABLE ops (id TEXT PRIMARY KEY, k TEXT NOT NULL UNIQUE, at REAL, body TEXT)")
            conn.execute("CREATE INDEX ops_at ON ops (at)")
        for i in range(warm_up + samples):
            for mode, conn in conns.items():
                start = time.perf_counter()
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(
                    "INSERT INTO ops VALUES (?, ?, ?, ?)", (uuid.uuid4().hex, f"k{i}", start, "x" * 300)
                )
                conn.execute("COMMIT")
                if i >= warm_up:
                    timings[mode].append(time.perf_counter() - start)
    finally:
        for conn in conns.values():
            conn.close()
        for probe in directory.glob(".commit-probe-*"):
            probe.unlink(missing_ok=True)
    full, normal = (statistics.median(timings[mode]) for mode in ("FULL", "NORMAL"))
    return round(max(0.0, full - normal) * 1e6, 1)


class DiskFloor:
    """The least a durable write can cost on this filesystem: overwrite one 4 KiB frame of a
    preallocated file and fdatasync it, as a WAL commit at its least does. Timed inside the
    overhead rounds, beside the calls, so that a busy disk or CPU weighs on both alike."""

    FRAME = 4096
    FRAMES = 64

    def __init__(self, directory: Path) -> None:
        self.path = directory / f".disk-floor-{uuid.uuid4().hex}"
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        os.write(self._fd, os.urandom(self.FRAME * self.FRAMES))  # allocated, so no sync grows the file
        os.fsync(self._fd)
        self._frame = os.urandom(self.FRAME)
        self._next = 0
        self.samples: list[list[float]] = []  # µs, one list per round

    def sample(self) -> float:
        start = time.perf_counter_ns()
        os.pwrite(self._fd, self._frame, (self._next % self.FRAMES) * self.FRAME)
        getattr(os, "fdatasync", os.fsync)(self._fd)
        self._next += 1
        return (time.perf_counter_ns() - start) / 1000.0

    def close(self) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)


# --- the workspace: a sandbox, policies, server processes -----------------------------------------------


@dataclass
class Bench:
    root: Path
    scale: Scale
    log: TextIO
    progress: Progress
    raw: dict[str, Any] = field(default_factory=dict)  # samples for plots, kept out of the JSON

    def __post_init__(self) -> None:
        from commitgate.server.demo.sandbox import Sandbox

        self.box = Sandbox(self.root)
        os.environ["COMMITGATE_SANDBOX"] = str(self.root / "sandbox.db")  # so demo.rows() reads this store
        os.environ.pop("COMMITGATE_SANDBOX_FAULTS", None)

    def policy(self, name: str, text: str) -> Path:
        path = self.root / f"{name}.toml"
        path.write_text(text)
        return path

    def ledger(self, name: str) -> Path:
        return self.root / f"{name}.db"

    def serve(
        self,
        policy: Path | None,
        ledger: Path,
        faults: str = "",
        env: dict[str, str] | None = None,
        stdio: str | None = None,
    ) -> StdioServerParameters:
        args = ["-m", "commitgate.server.cli", "serve", "--ledger", f"sqlite:///{ledger}"]
        if stdio is not None:  # else `serve`'s default transport, the one users get
            args += ["--stdio", stdio]
        if policy is not None:
            args += ["--policy", str(policy)]
        server_env = {**self.box.env, "COMMITGATE_SANDBOX_FAULTS": faults, **(env or {})}
        return StdioServerParameters(command=sys.executable, args=args, env=server_env)

    def plain(self) -> StdioServerParameters:
        return StdioServerParameters(
            command=sys.executable, args=["-m", "commitgate.tools.plain_server"], env=self.box.env
        )

    @contextlib.asynccontextmanager
    async def connect(self, params: StdioServerParameters, timeout: float = 120.0) -> AsyncIterator[Client]:
        """A real MCP client over stdio; the server's stderr goes to the bench log, not the progress bars."""
        async with Client(stdio_client(params, errlog=self.log), read_timeout_seconds=timeout) as client:
            yield client

    def task(self, description: str, total: int) -> Callable[[int], None]:
        task_id = self.progress.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            self.progress.advance(task_id, n)

        return advance


# --- experiment 1: double charge ------------------------------------------------------------------------


async def double_charge(bench: Bench) -> dict[str, Any]:
    bookings = bench.scale.bookings
    tick = bench.task("double charge", 2 * bookings)
    naive = await _bookings(bench, guarded=False, tick=tick)
    guarded = await _bookings(bench, guarded=True, tick=tick)
    return {
        "sandbox": "demo sandbox store (SQLite), fault charge_card.lose_ack=50%: the charge commits, "
        "then its acknowledgement is lost",
        "naive": naive,
        "guarded": guarded,
    }


async def _bookings(bench: Bench, *, guarded: bool, tick: Callable[[int], None]) -> dict[str, Any]:
    from commitgate.server.demo.sandbox import (
        NAIVE_POLICY,  # safe-retry, one attempt: what an agent gets without commitgate
    )

    arm = "guarded" if guarded else "naive"
    policy = None if guarded else bench.policy("naive-charge", NAIVE_POLICY)
    params = bench.serve(policy, bench.ledger(f"double-charge-{arm}"), faults="charge_card.lose_ack=50%")
    bookings = bench.scale.bookings
    calls = recovered = 0
    started = time.perf_counter()
    async with bench.connect(params) as client:

        async def book(n: int) -> None:
            nonlocal calls, recovered
            arguments: dict[str, Any] = {"card": f"{arm}-{n}", "amount_cents": 100 + n % 900}
            if guarded:
                arguments["idempotency_key"] = f"booking-{n}"
            while True:  # the agent retries until it sees success
                calls += 1
                result = await client.call_tool("charge_card", arguments)
                if not result.is_error:
                    break
                if calls > 100 * bookings:
                    raise BenchError(f"{arm}: booking {n} never succeeded: {result.content}")
            recovered += bool(operation_of(result).get("replayed"))
            tick(1)

        await pool(bookings, bench.scale.agents, book)
    seconds = time.perf_counter() - started
    from commitgate.tools import demo

    per_booking = Counter(
        row["card"] for row in demo.rows("charges") if str(row["card"]).startswith(f"{arm}-")
    )
    charges = sum(per_booking.values())
    figures = {
        "bookings": bookings,
        "charges": charges,
        "duplicate_charges": charges - bookings,
        "duplicate_rate": round((charges - bookings) / bookings, 4),
        "double_charged_bookings": sum(1 for n in per_booking.values() if n > 1),
        "uncharged_bookings": bookings - len(per_booking),
        "retries": calls - bookings,
        "seconds": round(seconds, 2),
    }
    if guarded:
        figures["lost_acks_recovered_by_status_check"] = recovered
    return figures


# --- experiment 2: saga ----------------------------------------------------------------------------------


@dataclass
class _Order:
    n: int
    booking_id: str = ""
    confirmed: bool = False

    @property
    def session(self) -> str:
        return f"saga-order-{self.n}"

    @property
    def card(self) -> str:
        return f"saga-card-{self.n}"

    @property
    def amount(self) -> int:
        return 1000 + self.n


async def saga(bench: Bench) -> dict[str, Any]:
    orders = [_Order(n) for n in range(bench.scale.orders)]
    tick = bench.task("saga", 2 * len(orders))
    faults = "confirm.fail_permanent=30%,refund.lose_ack=30%"
    outcomes: Counter[str] = Counter()
    started = time.perf_counter()
    async with bench.connect(bench.serve(None, bench.ledger("saga"), faults=faults)) as client:

        async def call(order: _Order, tool: str, key: str, **arguments: Any) -> CallToolResult:
            arguments["idempotency_key"] = key
            return await client.call_tool(tool, arguments, meta=session_meta(order.session))

        async def book(index: int) -> None:
            order = orders[index]
            reserved = await call(order, "reserve", "reserve", resource=f"room-{order.n}", customer="c")
            paid = await call(order, "pay_booking", "pay", card=order.card, amount_cents=order.amount)
            if reserved.is_error or paid.is_error:
                raise BenchError(
                    f"saga order {order.n}: reserve/pay failed: {reserved.content} {paid.content}"
                )
            order.booking_id = str((reserved.structured_content or {})["booking_id"])
            confirmed = await call(order, "confirm", "confirm", booking_id=order.booking_id)
            order.confirmed = not confirmed.is_error
            if confirmed.is_error and error_code(confirmed) != "operation_failed":
                raise BenchError(f"saga order {order.n}: unexpected confirm answer {confirmed.content}")
            tick(1)

        await pool(len(orders), bench.scale.agents, book)
        failed = [order for order in orders if not order.confirmed]
        before = _charged_unconfirmed(orders)

        async def compensate(order: _Order) -> dict[str, Any]:
            answer = await client.call_tool(
                "compensate_session", {"reason": "confirmation failed"}, meta=session_meta(order.session)
            )
            return dict(answer.structured_content or {})

        async def undo(index: int) -> None:
            order = failed[index]
            async with anyio.create_task_group() as group:  # a retry racing the first call
                for _ in range(2):
                    group.start_soon(compensate, order)
            outcomes[str((await compensate(order)).get("state"))] += 1  # and once more, later
            tick(1)

        tick(len(orders) - len(failed))
        await pool(len(failed), bench.scale.agents, undo)
    return {
        "orders": len(orders),
        "confirmation_failures": len(failed),
        "faults": faults,
        "charged_without_confirmation_before": before,
        "charged_without_confirmation_after": _charged_unconfirmed(orders),
        "compensate_session_calls": 3 * len(failed),
        "final_compensation_states": dict(outcomes),
        **_refund_counts(orders),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _charged_unconfirmed(orders: list[_Order]) -> int:
    """Orders whose customer is charged (not refunded) while the booking is not confirmed."""
    from commitgate.tools import demo

    charges = {row["card"]: row for row in demo.rows("charges")}
    status = {row["id"]: row["status"] for row in demo.rows("bookings")}
    count = 0
    for order in orders:
        charge = charges.get(order.card)
        if charge is None:
            continue
        charged = charge["amount_cents"] - charge["refunded_cents"] > 0
        count += charged and status.get(order.booking_id) != "confirmed"
    return count


def _refund_counts(orders: list[_Order]) -> dict[str, int]:
    from commitgate.tools import demo

    ours = {order.card for order in orders}
    charges = {row["id"]: row for row in demo.rows("charges") if row["card"] in ours}
    per_charge = Counter(row["charge_id"] for row in demo.rows("refunds") if row["charge_id"] in charges)
    released = {row["id"] for row in demo.rows("bookings", status="released")}
    return {
        "refunds": sum(per_charge.values()),
        "refunds_issued_twice": sum(1 for n in per_charge.values() if n > 1),
        "over_refunded_charges": sum(
            1 for charge in charges.values() if charge["refunded_cents"] > charge["amount_cents"]
        ),
        "bookings_released": sum(1 for order in orders if order.booking_id in released),
    }


# --- experiment 3: backoff -------------------------------------------------------------------------------


async def backoff(bench: Bench) -> dict[str, Any]:
    scale = bench.scale
    tick = bench.task("backoff", 2 * scale.retriers)
    arms = {}
    for arm, retry in (("immediate", IMMEDIATE_RETRY), ("full_jitter", JITTER_RETRY)):
        arms[arm] = await _retriers(bench, arm, retry, tick)
    return {
        "retriers": scale.retriers,
        "capacity": scale.capacity,
        "service_ms": {"median": scale.median_ms, "p99": scale.p99_ms},
        "retrying": "in commitgate's safe-retry class; the client calls again only on retries_exhausted",
        **arms,
    }


async def _retriers(bench: Bench, arm: str, retry: str, tick: Callable[[int], None]) -> dict[str, Any]:
    scale = bench.scale
    ledger = bench.ledger(f"backoff-{arm}")
    policy = bench.policy(f"backoff-{arm}", BACKOFF_POLICY.format(retry=retry))
    params = bench.serve(policy, ledger, env={"COMMITGATE_BENCH_CAPACITY": str(scale.capacity)})
    completion: list[float] = []
    client_calls = 0
    async with bench.connect(params, timeout=600.0) as client:
        pid = (server_pids(str(ledger)) or [0])[0]
        cpu_before = cpu_seconds(pid) or 0.0
        started = time.perf_counter()

        async def retrier(n: int) -> None:
            nonlocal client_calls
            arguments = {"job": f"job-{n}", "median_ms": scale.median_ms, "p99_ms": scale.p99_ms}
            while True:
                client_calls += 1
                result = await client.call_tool("work", arguments)
                if not result.is_error:
                    break
                if error_code(result) != "retries_exhausted":
                    raise BenchError(f"backoff {arm}: unexpected answer {result.content}")
            completion.append(time.perf_counter() - started)
            tick(1)

        await pool(scale.retriers, scale.retriers, retrier)
        load = (await client.call_tool("service_load", {})).structured_content or {}
        cpu = (cpu_seconds(pid) or 0.0) - cpu_before
    bench.raw.setdefault("backoff_completion_s", {})[arm] = completion
    return {
        "policy": f"retry = {retry}",
        "p50_completion_s": round(quantile(completion, 0.5), 3),
        "p99_completion_s": round(quantile(completion, 0.99), 3),
        "max_completion_s": round(max(completion), 3),
        "attempts": load.get("attempts"),
        "attempts_per_job": round(int(load.get("attempts", 0)) / scale.retriers, 1),
        "rejected": load.get("rejected"),
        "peak_in_service": load.get("peak_in_service"),
        "peak_attempts_per_s": load.get("peak_attempts_per_s"),
        "client_calls": client_calls,
        "server_cpu_s": round(cpu, 2),
    }


# --- experiment 4: concurrency -----------------------------------------------------------------------------


async def concurrency(bench: Bench) -> dict[str, Any]:
    scale = bench.scale
    tick = bench.task("concurrency", 2 * scale.dup_keys)
    return {
        "keys": scale.dup_keys,
        "duplicates_per_key": scale.dup_copies,
        "tool_latency_s": scale.tool_latency,
        "one_process": await _duplicates(bench, processes=1, tick=tick),
        "several_processes": await _duplicates(bench, processes=scale.processes, tick=tick),
    }


async def _duplicates(bench: Bench, *, processes: int, tick: Callable[[int], None]) -> dict[str, Any]:
    scale = bench.scale
    mode = f"p{processes}"
    ledger = bench.ledger(f"concurrency-{mode}")
    params = bench.serve(
        bench.policy("concurrency", CONCURRENCY_POLICY),
        ledger,
        faults=f"create_ticket.latency={scale.tool_latency}s",
    )
    answers: Counter[str] = Counter()
    started = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(bench.connect(params)) for _ in range(processes)]

        async def one(client: Client, key: str, k: int) -> None:
            result = await client.call_tool(
                "create_ticket", {"title": f"ticket {k}", "body": "bench", "idempotency_key": key}
            )
            if result.is_error:
                answers[str(error_code(result))] += 1
            else:
                answers["replayed" if operation_of(result).get("replayed") else "executed"] += 1

        async def duplicates(k: int) -> None:
            key = f"{mode}-key-{k}"
            async with anyio.create_task_group() as group:
                for copy in range(scale.dup_copies):
                    group.start_soon(one, clients[copy % processes], key, k)
            tick(1)

        await pool(scale.dup_keys, scale.keys_in_flight, duplicates)
    from commitgate.tools import demo

    effects = Counter(
        row["idempotency_key"]
        for row in demo.rows("tickets")
        if str(row["idempotency_key"]).startswith(f"{mode}-key-")
    )
    per_key = [effects.get(f"{mode}-key-{k}", 0) for k in range(scale.dup_keys)]
    return {
        "processes": processes,
        "calls": scale.dup_keys * scale.dup_copies,
        "effects": sum(per_key),
        "max_effects_per_key": max(per_key),
        "min_effects_per_key": min(per_key),
        "keys_not_exactly_once": sum(1 for n in per_key if n != 1),
        "answers": dict(answers),
        "seconds": round(time.perf_counter() - started, 2),
    }


# --- experiment 5: fresh keys -----------------------------------------------------------------------------
# An agent whose answer was lost calls again, but with a key of its own making, new on every
# try: the key cannot tell the retry from a new booking. Answers are lost on the client's side
# (after the server answered), which no status check can see.

FRESH_KEYS_POLICY = """
[server]
name = "commitgate-bench-fresh-keys"
[ledger]
synchronous = "FULL"
[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.tools.demo:charge_card"
status_check = "commitgate.tools.demo:find_charge"
{duplicates}
"""
LOST_ANSWERS = 0.5


async def fresh_keys(bench: Bench) -> dict[str, Any]:
    bookings = bench.scale.bookings
    tick = bench.task("fresh keys", 2 * bookings)
    return {
        "client": f"mints a new idempotency_key on every try; {LOST_ANSWERS:.0%} of answers are lost before it "
        "reads them; it stops at the first answer it reads (a success, or possible_duplicate with the earlier "
        "charge's result)",
        "without_detection": await _fresh_key_bookings(bench, detection=False, tick=tick),
        "with_detection": await _fresh_key_bookings(bench, detection=True, tick=tick),
    }


async def _fresh_key_bookings(
    bench: Bench, *, detection: bool, tick: Callable[[int], None]
) -> dict[str, Any]:
    arm = "detect" if detection else "nodetect"
    text = FRESH_KEYS_POLICY.format(duplicates="" if detection else "duplicates = false")
    params = bench.serve(bench.policy(f"fresh-keys-{arm}", text), bench.ledger(f"fresh-keys-{arm}"))
    bookings = bench.scale.bookings
    rng = random.Random(f"fresh-keys-{bench.scale.bookings}")  # the same losses for both arms
    calls = 0
    answers: Counter[str] = Counter()
    started = time.perf_counter()
    async with bench.connect(params) as client:

        async def book(n: int) -> None:
            nonlocal calls
            arguments: dict[str, Any] = {"card": f"fresh-{arm}-{n}", "amount_cents": 100 + n % 900}
            while True:
                calls += 1
                arguments["idempotency_key"] = f"booking-{n}-{uuid.uuid4().hex[:8]}"  # the naive part
                result = await client.call_tool("charge_card", arguments)
                code = error_code(result) or "success"
                if rng.random() < LOST_ANSWERS:
                    continue  # the answer never reached the agent
                answers[code] += 1
                if code in ("success", "possible_duplicate"):
                    break
                if calls > 100 * bookings:
                    raise BenchError(f"fresh keys ({arm}): booking {n} never settled: {result.content}")
            tick(1)

        await pool(bookings, bench.scale.agents, book)
    seconds = time.perf_counter() - started
    from commitgate.tools import demo

    per_booking = Counter(
        row["card"] for row in demo.rows("charges") if str(row["card"]).startswith(f"fresh-{arm}-")
    )
    charges = sum(per_booking.values())
    return {
        "bookings": bookings,
        "calls": calls,
        "charges": charges,
        "duplicate_charges": charges - bookings,
        "duplicate_rate": round((charges - bookings) / bookings, 4),
        "double_charged_bookings": sum(1 for c in per_booking.values() if c > 1),
        "uncharged_bookings": bookings - len(per_booking),
        "answers_read": dict(answers),
        "seconds": round(seconds, 2),
    }


# --- overhead: guarded, replayed and plain-SDK calls ---------------------------------------------------------------------------------


@dataclass
class _Variant:
    name: str
    client: Client
    tool: str
    arguments: Callable[[int, int], dict[str, Any]]
    replayed: bool | None  # what _meta must say (None: no operation block expected)
    samples: list[list[float]] = field(default_factory=list)  # µs, one list per round


async def _timed(variant: _Variant, round_no: int, i: int) -> float:
    arguments = variant.arguments(round_no, i)
    start = time.perf_counter_ns()
    result = await variant.client.call_tool(variant.tool, arguments)
    elapsed = (time.perf_counter_ns() - start) / 1000.0
    if result.is_error:
        raise BenchError(f"{variant.name}: {result.content}")
    if variant.replayed is not None and operation_of(result).get("replayed") is not variant.replayed:
        raise BenchError(f"{variant.name}: expected replayed={variant.replayed}, got {result.meta}")
    return elapsed


async def overhead(bench: Bench) -> dict[str, Any]:
    scale = bench.scale
    tick = bench.task("cost per call", scale.rounds)
    ledger = bench.ledger("overhead")
    lazy = OVERHEAD_POLICY.replace('synchronous = "FULL"', 'synchronous = "NORMAL"')
    claim_only = OVERHEAD_POLICY.replace('synchronous = "FULL"', 'synchronous = "FULL"\ndurability = "claim"')
    servers = {
        "gate": bench.serve(bench.policy("overhead", OVERHEAD_POLICY), ledger),
        "plain": bench.plain(),
        "no_fsync": bench.serve(bench.policy("overhead-normal", lazy), bench.ledger("overhead-normal")),
        "claim_durability": bench.serve(
            bench.policy("overhead-claim", claim_only), bench.ledger("overhead-claim")
        ),
        "sdk_stdio": bench.serve(
            bench.policy("overhead", OVERHEAD_POLICY), bench.ledger("overhead-sdk-stdio"), stdio="sdk"
        ),
    }
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(bench.connect(p)) for name, p in servers.items()}
        variants = _overhead_variants(clients)
        for variant in variants:  # warm every path up; the replays' keys are among these
            for i in range(_REPLAY_KEYS):
                await variant.client.call_tool(variant.tool, variant.arguments(-1, i))
        floor = DiskFloor(bench.root)
        try:
            for round_no in range(scale.rounds):
                await _round(variants, round_no, scale.calls_per_round, floor)
                tick(1)
        finally:
            floor.close()
    by_name = {variant.name: variant for variant in variants}
    bench.raw["overhead_us"] = {name: [s for r in v.samples for s in r] for name, v in by_name.items()}
    sync_us = commit_sync_us(bench.root)
    unguarded = statistics.median(bench.raw["overhead_us"]["unguarded"])

    def ratio(top: str, bottom: str) -> dict[str, float]:
        return _paired(by_name[top], by_name[bottom])

    return {
        "rounds": scale.rounds,
        "calls_per_round": scale.calls_per_round,
        "interleaving": "one call of each variant in turn, in a fresh random order each time; ratios paired per round",
        "per_call_us": {
            name: spread([statistics.median(r) for r in v.samples], 1) for name, v in by_name.items()
        },
        "ratios": {
            "guarded_over_unguarded": ratio("guarded", "unguarded"),
            "replay_over_unguarded": ratio("replay", "unguarded"),
            "guarded_over_plain_sdk": ratio("guarded", "plain_sdk"),
            "sdk_stdio_guarded_over_unguarded": ratio("guarded_sdk_stdio", "unguarded_sdk_stdio"),
            "sdk_stdio_guarded_over_plain_sdk": ratio("guarded_sdk_stdio", "plain_sdk"),
            "unguarded_over_plain_sdk": ratio("unguarded", "plain_sdk"),
            "sdk_stdio_unguarded_over_unguarded": ratio("unguarded_sdk_stdio", "unguarded"),
            "guarded_no_fsync_over_unguarded": ratio("guarded_no_fsync", "unguarded"),
            "guarded_over_guarded_no_detection": ratio("guarded", "guarded_no_detection"),
            "claim_durability_over_unguarded": ratio("guarded_claim_durability", "unguarded"),
            "claim_durability_over_plain_sdk": ratio("guarded_claim_durability", "plain_sdk"),
        },
        "disk_floor_us": spread([statistics.median(r) for r in floor.samples], 1),
        "overhead_over_floor": {
            "full": _over_floor(by_name["guarded"], by_name["unguarded"], floor),
            "claim": _over_floor(by_name["guarded_claim_durability"], by_name["unguarded"], floor),
        },
        "variants": {
            "unguarded, guarded, replay": "commitgate serve as users get it (the lean stdio transport)",
            "guarded_no_fsync": "the guarded call on a ledger with synchronous=NORMAL (no fsync per commit)",
            "guarded_claim_durability": 'the guarded call with [ledger] durability = "claim" (one sync per call)',
            "disk_floor": "overwrite a 4 KiB frame of a preallocated file + fdatasync, in the ledgers' directory",
            "*_sdk_stdio": "the same server on the MCP SDK's stdio transport (commitgate serve --stdio sdk)",
        },
        "commit_sync_us": sync_us,
        "guarded_over_unguarded_floor": round(1 + 2 * sync_us / unguarded, 3),
        "syncs_in_server": _syncs_in_server(by_name),
        "duplicate_lookup": _duplicate_lookup(by_name),
        "ledger_bytes_per_operation": _bytes_per_operation(ledger),
    }


_REPLAY_KEYS = 50


def _overhead_variants(clients: dict[str, Client]) -> list[_Variant]:
    """The same no-op nine ways; only the guarded ones carry a key (a new one, or one already seen)."""
    run = uuid.uuid4().hex[:8]

    def new_key(r: int, i: int) -> dict[str, Any]:
        # arguments of their own too: the same ones under a new key would be a possible duplicate
        return {"n": (r + 2) * 1_000_000 + i, "idempotency_key": f"{run}-{r}-{i}"}

    def other_new_key(r: int, i: int) -> dict[str, Any]:  # another tool on the same ledger: its own keys
        return {**new_key(r, i), "idempotency_key": f"{run}-unchecked-{r}-{i}"}

    def seen_key(r: int, i: int) -> dict[str, Any]:
        return new_key(-1, i % _REPLAY_KEYS)  # a call the warm-up made (the guarded variant warms up first)

    def bare(r: int, i: int) -> dict[str, Any]:
        return {"n": i}

    gate, sdk_stdio = clients["gate"], clients["sdk_stdio"]
    return [
        _Variant("unguarded", gate, "noop", bare, None),
        _Variant("guarded", gate, "noop_keyed", new_key, False),
        _Variant("guarded_no_detection", gate, "noop_keyed_unchecked", other_new_key, False),
        _Variant("replay", gate, "noop_keyed", seen_key, True),
        _Variant("plain_sdk", clients["plain"], "noop", bare, None),
        _Variant("guarded_no_fsync", clients["no_fsync"], "noop_keyed", new_key, False),
        _Variant("guarded_claim_durability", clients["claim_durability"], "noop_keyed", new_key, False),
        _Variant("unguarded_sdk_stdio", sdk_stdio, "noop", bare, None),
        _Variant("guarded_sdk_stdio", sdk_stdio, "noop_keyed", new_key, False),
    ]


async def _round(variants: list[_Variant], round_no: int, calls: int, floor: DiskFloor | None = None) -> None:
    for variant in variants:
        variant.samples.append([])
    if floor is not None:
        floor.samples.append([])
    order: list[_Variant | None] = [*variants, None] if floor is not None else list(variants)
    for i in range(calls):
        # A fresh order each time: a fixed cycle always hands the same server to the same variant
        # just after another server ran (caches and wake-ups cold), which biased the ratios.
        random.shuffle(order)
        for item in order:
            if item is None:
                assert floor is not None
                floor.samples[-1].append(floor.sample())
            else:
                item.samples[-1].append(await _timed(item, round_no, i))


def _paired(top: _Variant, bottom: _Variant) -> dict[str, float]:
    ratios = [
        statistics.median(a) / statistics.median(b) for a, b in zip(top.samples, bottom.samples, strict=True)
    ]
    return spread(ratios)


def _over_floor(guarded: _Variant, unguarded: _Variant, floor: DiskFloor) -> dict[str, float]:
    """What the guard adds to a call, in units of what durability needs: (guarded - unguarded) ÷
    (2 × the disk floor), per round. 1.0 would be a guard whose only cost is its two syncs."""
    rounds = zip(guarded.samples, unguarded.samples, floor.samples, strict=True)
    return spread(
        [(statistics.median(g) - statistics.median(u)) / (2 * statistics.median(f)) for g, u, f in rounds]
    )


def _syncs_in_server(by_name: dict[str, _Variant]) -> dict[str, dict[str, float]]:
    """What the two durable commits cost a guarded call in a server: guarded minus the same call on a
    ledger without syncs, per round, in µs and as a share of the unguarded call (what they add to the guarded call's ratio)."""
    rounds = zip(
        by_name["guarded"].samples,
        by_name["guarded_no_fsync"].samples,
        by_name["unguarded"].samples,
        strict=True,
    )
    added = [(statistics.median(g), statistics.median(n), statistics.median(u)) for g, n, u in rounds]
    return {
        "us_per_call": spread([g - n for g, n, _ in added], 1),
        "added_to_guarded_ratio": spread([(g - n) / u for g, n, u in added]),
    }


def _duplicate_lookup(by_name: dict[str, _Variant]) -> dict[str, dict[str, float]]:
    """What duplicate detection (one indexed lookup in the claim, one more index entry) adds to a
    guarded call: guarded minus the same tool with `duplicates = false`, per round."""
    rounds = zip(
        by_name["guarded"].samples,
        by_name["guarded_no_detection"].samples,
        by_name["unguarded"].samples,
        strict=True,
    )
    added = [(statistics.median(g), statistics.median(n), statistics.median(u)) for g, n, u in rounds]
    return {
        "us_per_call": spread([g - n for g, n, _ in added], 1),
        "added_to_guarded_ratio": spread([(g - n) / u for g, n, u in added]),
    }


def _bytes_per_operation(ledger: Path) -> float | None:
    """File bytes (database + WAL) per operation of a ledger written by real guarded calls."""
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as conn:
        operations = conn.execute("SELECT count(*) FROM operations").fetchone()[0]
    size = sum(p.stat().st_size for p in (ledger, Path(f"{ledger}-wal")) if p.exists())
    return round(size / operations, 1) if operations else None


# --- the ledger alone: throughput ------------------------------------------------------------------------------------


async def ledger_alone(bench: Bench) -> dict[str, Any]:
    from commitgate.server.bench.ledger import run_ledger_bench

    tick = bench.task("ledger alone", 1)
    figures = await run_ledger_bench(bench.ledger("ledger-alone"), ops=bench.scale.ledger_ops, tasks=64)
    tick(1)
    return figures


# --- memory, ledger size, start-up -----------------------------------------------------------------------------


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
        pids = server_pids(str(ledger))
        if not pids:
            raise BenchError(f"no server process found for {ledger}")
        return {"vm_rss": proc_status_kib(pids[0], "VmRSS"), "vm_hwm": proc_status_kib(pids[0], "VmHWM")}


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
_BULK_AUDIT = """
INSERT INTO audit (operation_id, at, event, from_state, to_state, fence, actor)
SELECT operation_id, created_at + :offset, :event, :from_state, :to_state, 1, 'bench-host:4242:0a1b2c3d'
FROM operations ORDER BY rowid
"""


def _bulk_insert(path: Path, rows: int) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = DELETE")  # one big transaction: no WAL growth, no fsyncs
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -200000")
        conn.execute("BEGIN")
        conn.execute(_BULK_OPERATIONS, {"rows": rows, "now": time.time()})
        for event, from_state, to_state, offset in (
            ("claimed", None, "RUNNING", 0.0),
            ("succeeded", "RUNNING", "SUCCEEDED", 0.004),
        ):
            conn.execute(
                _BULK_AUDIT,
                {"offset": offset, "event": event, "from_state": from_state, "to_state": to_state},
            )
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode = WAL")  # as the ledger keeps it
    finally:
        conn.close()


# --- the run ---------------------------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Bench], Awaitable[dict[str, Any]]]] = {
    "double_charge": double_charge,
    "saga": saga,
    "backoff": backoff,
    "concurrency": concurrency,
    "fresh_keys": fresh_keys,
    "overhead": overhead,
    "ledger": ledger_alone,
    "memory": memory,
    "tracing": lambda bench: _tracing().tracing_cost(bench),
}


def _tracing() -> Any:
    """The tracing section's module (it imports this one, so it is loaded on first use)."""
    from commitgate.server.bench import tracing

    return tracing


@dataclass(frozen=True, slots=True)
class Options:
    quick: bool = False
    json_path: Path | None = None
    plot_path: Path | None = None
    only: tuple[str, ...] = SECTIONS
    seed: int = 7


async def run_bench(options: Options, console: Console | None = None) -> dict[str, Any]:
    """Run the chosen sections and return every figure (the same document `--json` writes)."""
    console = console or Console(width=None if sys.stdout.isatty() else 150)
    scale = QUICK if options.quick else FULL
    random.seed(options.seed)
    results: dict[str, Any] = {"meta": _meta(options, scale)}
    with tempfile.TemporaryDirectory(prefix="commitgate-bench-") as tmp:
        root = Path(tmp)
        columns = (
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with (root / "servers.log").open("w") as log, Progress(*columns, console=console) as progress:
            bench = Bench(root, scale, log, progress)
            try:
                for name in options.only:
                    results[name] = await RUNNERS[name](bench)
            except BaseException:
                log.flush()
                _show_log_tail(console, root / "servers.log")
                raise
        results["goals"] = goals(results)
        results["checks"] = checks(results)
        results["meta"]["seconds"] = round(time.perf_counter() - results["meta"].pop("_started"), 1)
        console.print(results_table(results))
        for line in missed_notes(results):
            console.print(line)
        if options.plot_path is not None:
            console.print(plot(results, bench.raw, options.plot_path))
    return results


def _meta(options: Options, scale: Scale) -> dict[str, Any]:
    return {
        "command": "commitgate bench" + (" --quick" if options.quick else ""),
        "quick": options.quick,
        "scale": asdict(scale),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "_started": time.perf_counter(),
    }


def _show_log_tail(console: Console, path: Path, lines: int = 30) -> None:
    with contextlib.suppress(OSError):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        if tail:
            console.print("[bold]last lines of the servers' stderr:[/]")
            for line in tail:
                console.print(line, markup=False)


# --- goals and correctness checks ------------------------------------------------------------------------------


def goals(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ratios = results.get("overhead", {}).get("ratios", {})
    for goal, key, limit in (
        ("guarded_call_cost", "guarded_over_unguarded", 1.15),
        ("replay_cost", "replay_over_unguarded", 1.05),
        ("cost_against_plain_sdk", "guarded_over_plain_sdk", 1.0),
    ):
        if key in ratios:
            figure = ratios[key]
            out[goal] = {
                "measure": key,
                "ratio": figure["median"],
                "spread": figure,
                "goal": f"<= {limit}",
                "met": figure["median"] <= limit,
            }
    if "guarded_call_cost" in out:
        out["guarded_call_cost"]["aim"] = "<= 1.05"
    if "replay_cost" in out:
        out["replay_cost"]["aim"] = "<= 1.02"
    if "cost_against_plain_sdk" in out:
        sdk_stdio = ratios.get("sdk_stdio_guarded_over_plain_sdk")
        if sdk_stdio:
            out["cost_against_plain_sdk"]["with_sdk_stdio"] = sdk_stdio
    if "guarded_call_cost" in out and "sdk_stdio_guarded_over_unguarded" in ratios:
        out["guarded_call_cost"]["with_sdk_stdio"] = ratios["sdk_stdio_guarded_over_unguarded"]
    over_floor = results.get("overhead", {}).get("overhead_over_floor", {}).get("full")
    if over_floor:
        out["guard_over_floor"] = {
            "measure": "(guarded new-key call - unguarded call) / (2 x (overwrite 4 KiB + fdatasync))",
            "ratio": over_floor["median"],
            "spread": over_floor,
            "goal": "<= 2.0",
            "met": over_floor["median"] <= 2.0,
        }
    ledger = results.get("ledger", {}).get("concurrent_claim_complete")
    if ledger:
        out["ledger_throughput"] = {
            "measure": "ledger alone, 64 tasks, durable claim+complete",
            "ops_per_s": ledger["ops_per_s"],
            "p99_ms": round(ledger["p99_us"] / 1000, 2),
            "goal": ">= 15000 ops/s with p99 <= 8 ms",
            "met": ledger["ops_per_s"] >= 15_000 and ledger["p99_us"] <= 8_000,
        }
    return out


def checks(results: dict[str, Any]) -> dict[str, bool]:
    """The correctness claims of the experiments; any False makes the command fail."""
    out: dict[str, bool] = {}
    if "double_charge" in results:
        out["double charge: no duplicate charge through commitgate"] = (
            results["double_charge"]["guarded"]["duplicate_charges"] == 0
        )
    if "saga" in results:
        saga_figures = results["saga"]
        out["saga: nobody charged without confirmation after compensation"] = (
            saga_figures["charged_without_confirmation_after"] == 0
        )
        out["saga: no refund issued twice"] = saga_figures["refunds_issued_twice"] == 0
    if "fresh_keys" in results:
        out["fresh keys: no duplicate charge with duplicate detection"] = (
            results["fresh_keys"]["with_detection"]["duplicate_charges"] == 0
        )
    if "concurrency" in results:
        for mode in ("one_process", "several_processes"):
            figures = results["concurrency"][mode]
            out[f"concurrency ({mode.replace('_', ' ')}): one effect per key"] = (
                figures["keys_not_exactly_once"] == 0
            )
    return out


# --- output: the table and the plot ---------------------------------------------------------------------------------

Row = tuple[str, str, str, str, str]


TARGET_ROWS = {
    "guard_over_floor": "what the guard adds to a call (guarded with a new key minus unguarded), in units of "
    "the two disk syncs that durability needs (a 4 KiB overwrite + fdatasync, twice)",
    "guarded_call_cost": "time of a guarded call with a new key ÷ the same tool unguarded",
    "replay_cost": "time of a replayed answer ÷ the same tool unguarded",
    "cost_against_plain_sdk": "time of a guarded call ÷ a no-op tool on a plain MCP SDK server",
    "ledger_throughput": "ledger alone: 64 tasks recording and completing operations",
}


def missed_notes(results: dict[str, Any]) -> list[str]:
    """Below the table: why each missed target was missed, in words, and any failed safety check."""
    targets, overhead = results.get("goals", {}), results.get("overhead", {})
    load = results["meta"].get("load_average_at_start", [0.0])[0]
    busy = (
        f" The machine was busy (load average {load:.1f} at the start), which slows every figure."
        if load >= 1
        else ""
    )
    why = {
        "guard_over_floor": "besides its two syncs a guarded call runs the claim's and the outcome's "
        "transactions, its work task and a larger answer in Python, which on this machine cost more than "
        'the syncs themselves. The rows for durability = "claim" show the call with one sync fewer.',
        "guarded_call_cost": "a guarded call writes the ledger durably before and after the effect; on this disk "
        f"those two commits alone put the ratio at {overhead.get('guarded_over_unguarded_floor', 0):.3f} or more. "
        "The row without disk syncs shows what the guard costs in software.",
        "replay_cost": "a replay is answered from the ledger without running the tool; its small margin is "
        "easily eaten by noise, so compare runs on an idle machine.",
        "cost_against_plain_sdk": "a plain SDK server's tool does nothing and records nothing; the guarded call "
        "claims, commits twice and runs the tool.",
        "ledger_throughput": "the ledger alone is bound by CPU and the disk's sync time, shared with whatever "
        "else runs on the machine.",
    }
    lines = [
        f"[bold]{TARGET_ROWS[name]}[/] missed its target ({target['goal']}): {why[name]}{busy}"
        for name, target in targets.items()
        if not target.get("met", True) and name in why
    ]
    lines += [
        f"[red]safety check failed:[/] {claim}" for claim, ok in results.get("checks", {}).items() if not ok
    ]
    return lines


VARIANT_NAMES = {
    "plain_sdk": "plain SDK server",
    "guarded_no_fsync": "guarded without disk syncs",
    "guarded_claim_durability": 'guarded with durability = "claim"',
    "unguarded_sdk_stdio": "unguarded on the SDK's stdio",
    "guarded_sdk_stdio": "guarded on the SDK's stdio",
}


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else "[green]met[/]" if ok else "[red]missed (see below)[/]"


def _ratio_text(figure: dict[str, float]) -> str:
    return (
        f"{figure['median']:.3f}  [dim](IQR {figure['p25']:.3f}–{figure['p75']:.3f}, "
        f"range {figure['min']:.3f}–{figure['max']:.3f})[/]"
    )


def results_table(results: dict[str, Any]) -> Table:
    table = Table(title=f"commitgate bench — {results['meta']['command']}", show_lines=False)
    for column in ("", "what is measured", "result", "target (what good looks like)", ""):
        table.add_column(column)
    rows: list[Row] = []
    for section, build in (
        ("double_charge", _rows_double_charge),
        ("saga", _rows_saga),
        ("backoff", _rows_backoff),
        ("concurrency", _rows_concurrency),
        ("fresh_keys", _rows_fresh_keys),
        ("overhead", _rows_overhead),
        ("ledger", _rows_ledger),
        ("memory", _rows_memory),
        ("tracing", lambda r: _tracing().rows(r)),
    ):
        if section in results:
            rows += build(results)
    previous = ""
    for row in rows:
        table.add_row(row[0] if row[0] != previous else "", *row[1:], end_section=False)
        previous = row[0]
    return table


def _rows_double_charge(results: dict[str, Any]) -> list[Row]:
    naive, guarded = results["double_charge"]["naive"], results["double_charge"]["guarded"]
    return [
        (
            "double charge",
            "calling the tool directly: extra charges",
            f"{naive['duplicate_charges']} / {naive['bookings']} bookings ({naive['duplicate_rate']:.0%}), "
            f"{naive['retries']} retries",
            "(the problem: about 1 per booking when half the answers are lost)",
            "—",
        ),
        (
            "double charge",
            "through commitgate: extra charges",
            f"{guarded['duplicate_charges']}  ({guarded['retries']} retries; "
            f"{guarded.get('lost_acks_recovered_by_status_check', 0)} lost answers recovered by asking the"
            " payments system)",
            "0",
            _verdict(guarded["duplicate_charges"] == 0),
        ),
    ]


def _rows_saga(results: dict[str, Any]) -> list[Row]:
    figures = results["saga"]
    return [
        (
            "saga",
            "charged without confirmation, before compensation",
            f"{figures['charged_without_confirmation_before']} / {figures['orders']} orders",
            "≈ 30 %",
            "—",
        ),
        (
            "saga",
            "… after compensate_session (sent 3× per order)",
            str(figures["charged_without_confirmation_after"]),
            "0",
            _verdict(figures["charged_without_confirmation_after"] == 0),
        ),
        (
            "saga",
            "refunds issued twice",
            f"{figures['refunds_issued_twice']}  ({figures['refunds']} refunds, 30 % of their answers lost)",
            "0",
            _verdict(figures["refunds_issued_twice"] == 0),
        ),
    ]


def _rows_backoff(results: dict[str, Any]) -> list[Row]:
    figures = results["backoff"]
    rows: list[Row] = []
    for arm, label in (("immediate", "immediate retries"), ("full_jitter", "exp. backoff, full jitter")):
        a = figures[arm]
        rows.append(
            (
                "backoff",
                f"{label}: completion p50 / p99",
                f"{a['p50_completion_s']:.2f} s / {a['p99_completion_s']:.2f} s",
                f"{figures['retriers']} retriers, {figures['capacity']} slots",
                "—",
            )
        )
        rows.append(
            (
                "backoff",
                f"{label}: attempts, peak load",
                f"{a['attempts']} attempts ({a['attempts_per_job']}/job), peak {a['peak_attempts_per_s']:.0f}/s, "
                f"server CPU {a['server_cpu_s']} s",
                "",
                "—",
            )
        )
    fewer = figures["full_jitter"]["attempts"] < figures["immediate"]["attempts"]
    rows.append(
        (
            "backoff",
            "jitter: fewer attempts, lower peak",
            "",
            "backoff + jitter sheds load",
            _verdict(fewer),
        )
    )
    return rows


def _rows_concurrency(results: dict[str, Any]) -> list[Row]:
    figures = results["concurrency"]
    rows: list[Row] = []
    for mode in ("one_process", "several_processes"):
        m = figures[mode]
        rows.append(
            (
                "concurrency",
                f"{m['processes']} process(es): effects per key",
                f"{m['min_effects_per_key']}–{m['max_effects_per_key']} over {figures['keys']} keys × "
                f"{figures['duplicates_per_key']} duplicates ("
                + ", ".join(f"{n} {kind}" for kind, n in sorted(m["answers"].items()))
                + ")",
                "1",
                _verdict(m["keys_not_exactly_once"] == 0),
            )
        )
    return rows


def _rows_fresh_keys(results: dict[str, Any]) -> list[Row]:
    off, on = results["fresh_keys"]["without_detection"], results["fresh_keys"]["with_detection"]
    return [
        (
            "fresh keys",
            "new key per retry, no duplicate detection: duplicate charges",
            f"{off['duplicate_charges']} / {off['bookings']} bookings ({off['duplicate_rate']:.0%}), "
            f"{off['calls']} calls",
            "≈ 1 per booking at 50 % lost answers",
            "—",
        ),
        (
            "fresh keys",
            "new key per retry, duplicate detection (default): duplicate charges",
            f"{on['duplicate_charges']}  ({on['calls']} calls; "
            f"{on['answers_read'].get('possible_duplicate', 0)} possible_duplicate answers read)",
            "0",
            _verdict(on["duplicate_charges"] == 0),
        ),
    ]


def _rows_overhead(results: dict[str, Any]) -> list[Row]:
    figures, goal = results["overhead"], results["goals"]
    calls = figures["per_call_us"]
    rows: list[Row] = [
        (
            "cost",
            "time per call (median of round medians)",
            ", ".join(
                f"{VARIANT_NAMES.get(name, name)} {value['median']:.0f} µs" for name, value in calls.items()
            ),
            "lower is better",
            "—",
        )
    ]
    for name in ("guard_over_floor", "guarded_call_cost", "replay_cost", "cost_against_plain_sdk"):
        if name not in goal:
            continue
        g, text = goal[name], TARGET_ROWS[name]
        target = g["goal"] + (f" (aim {g['aim']})" if "aim" in g else "")
        rows.append(("cost", text, _ratio_text(g["spread"]), target, _verdict(g["met"])))
    floor = figures.get("disk_floor_us")
    if floor:
        rows.append(
            (
                "cost",
                "the disk floor, timed in the same rounds: overwrite 4 KiB of a preallocated file + fdatasync",
                f"{floor['median']:.0f} µs (IQR {floor['p25']:.0f}–{floor['p75']:.0f})",
                "set by the disk, not by commitgate",
                "—",
            )
        )
    claim = figures["ratios"].get("claim_durability_over_unguarded")
    if claim:
        over = figures["overhead_over_floor"]["claim"]
        rows += [
            (
                "cost",
                'with \\[ledger] durability = "claim" (outcome synced within 50 ms, not before the answer): '
                "guarded ÷ unguarded",
                _ratio_text(claim),
                "the price of the full guarantee is the difference to the row above",
                "—",
            ),
            (
                "cost",
                'with durability = "claim": what the guard adds, in units of two disk syncs',
                _ratio_text(over),
                "<= 2.0",
                _verdict(over["median"] <= 2.0),
            ),
            (
                "cost",
                'with durability = "claim": guarded ÷ plain MCP SDK server',
                _ratio_text(figures["ratios"]["claim_durability_over_plain_sdk"]),
                "<= 1.0",
                _verdict(figures["ratios"]["claim_durability_over_plain_sdk"]["median"] <= 1.0),
            ),
        ]
    for name, text, limit in (
        (
            "guarded_call_cost",
            "guarded ÷ unguarded, both on the SDK's stdio transport (--stdio sdk)",
            "<= 1.15",
        ),
        (
            "cost_against_plain_sdk",
            "guarded on the SDK's stdio transport ÷ plain MCP SDK server",
            "<= 1.0",
        ),
    ):
        other = goal[name].get("with_sdk_stdio")
        if other:
            met = other["median"] <= float(limit.removeprefix("<= "))
            rows.append(("cost", text, _ratio_text(other), limit, _verdict(met)))
    rows.append(
        (
            "cost",
            "least a guarded call can cost: 2 durable commits (before and after the effect)",
            f"{figures['commit_sync_us']:.0f} µs per commit on this disk ⇒ guarded ÷ unguarded ≥ "
            f"{figures['guarded_over_unguarded_floor']:.3f}",
            "set by the disk, not by commitgate",
            "—",
        )
    )
    syncs = figures.get("syncs_in_server")
    if syncs:
        rows.append(
            (
                "cost",
                "what the 2 disk syncs add to guarded ÷ unguarded (guarded minus synchronous=NORMAL)",
                f"+{_ratio_text(syncs['added_to_guarded_ratio'])}; {syncs['us_per_call']['median']:.0f} µs per call",
                "the whole target allows +0.15",
                "—",
            )
        )
    lookup = figures.get("duplicate_lookup")
    if lookup:
        rows.append(
            (
                "overhead",
                "what duplicate detection adds to a guarded call (guarded minus duplicates = false)",
                f"+{_ratio_text(lookup['added_to_guarded_ratio'])}; {lookup['us_per_call']['median']:.0f} µs per call",
                "an indexed lookup in the claim",
                "—",
            )
        )
    no_fsync = figures["ratios"].get("guarded_no_fsync_over_unguarded")
    if no_fsync:
        rows.append(
            (
                "cost",
                "guarded ÷ unguarded without disk syncs (ledger synchronous=NORMAL)",
                _ratio_text(no_fsync),
                "the guard's software cost alone",
                "—",
            )
        )
    return rows


def _rows_ledger(results: dict[str, Any]) -> list[Row]:
    g3 = results["goals"]["ledger_throughput"]
    conc = results["ledger"]["concurrent_claim_complete"]
    seq = results["ledger"]["sequential_claim_complete"]
    batch = f", {conc['mean_batch']} operations per commit on average" if "mean_batch" in conc else ""
    return [
        (
            "ledger alone",
            TARGET_ROWS["ledger_throughput"].removeprefix("ledger alone: "),
            f"{conc['ops_per_s']:.0f} ops/s, p99 {g3['p99_ms']:.1f} ms{batch}",
            g3["goal"],
            _verdict(g3["met"]),
        ),
        (
            "ledger alone",
            "one at a time: claim+complete, dedup hit",
            f"{seq['median_us']:.0f} µs, {results['ledger']['dedup_hit']['median_us']:.0f} µs (medians)",
            "",
            "—",
        ),
    ]


def _rows_memory(results: dict[str, Any]) -> list[Row]:
    figures = results["memory"]
    rss = figures["rss_kib"]
    startup = figures["startup_ms"]
    served = results.get("overhead", {}).get("ledger_bytes_per_operation")
    per_op = f"{figures['ledger_bytes_per_operation']:.0f} B (bulk rows, 2 audit events each)"
    if served:
        per_op += f"; {served:.0f} B as served"
    return [
        (
            "memory",
            f"server RSS, ledger of {figures['ledger_rows']:,} rows",
            f"{(rss['big_ledger']['vm_rss'] or 0) / 1024:.1f} MiB "
            f"(empty ledger {(rss['empty_ledger']['vm_rss'] or 0) / 1024:.1f} MiB)",
            "",
            "—",
        ),
        ("memory", "ledger bytes per operation", per_op, "", "—"),
        (
            "memory",
            "start-up: spawn → first tools/list (median)",
            f"commitgate {startup['commitgate_empty_ledger']['median']:.0f} ms, with the big ledger "
            f"{startup['commitgate_big_ledger']['median']:.0f} ms, plain SDK {startup['plain_sdk']['median']:.0f} ms",
            "",
            "—",
        ),
    ]


def plot(results: dict[str, Any], raw: dict[str, Any], path: Path) -> str:
    """Draw the figures to `path` if matplotlib is importable; say what happened either way."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot skipped: matplotlib is not installed (pip install matplotlib)"
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    if "double_charge" in results:
        arms = results["double_charge"]
        axes[0][0].bar(
            ["naive", "commitgate"],
            [arms["naive"]["duplicate_charges"], arms["guarded"]["duplicate_charges"]],
        )
        axes[0][0].set_title("double charge: duplicate charges")
    for arm, times in raw.get("backoff_completion_s", {}).items():
        ordered = sorted(times)
        axes[0][1].plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=arm)
        axes[0][1].set_title("backoff: completion time (CDF)")
        axes[0][1].set_xlabel("seconds")
        axes[0][1].legend()
    if "overhead_us" in raw:
        names = list(raw["overhead_us"])
        axes[1][0].boxplot([raw["overhead_us"][n] for n in names], showfliers=False)
        axes[1][0].set_xticks(range(1, len(names) + 1), names)
        axes[1][0].set_title("overhead: µs per call")
    goal_figures = results.get("goals", {})
    ratios = {
        name: goal_figures[name]["ratio"]
        for name in ("guarded_call_cost", "replay_cost", "cost_against_plain_sdk")
        if name in goal_figures
    }
    if ratios:
        axes[1][1].bar(list(ratios), list(ratios.values()))
        axes[1][1].axhline(1.15, linestyle="--", color="grey")
        axes[1][1].axhline(1.05, linestyle=":", color="grey")
        axes[1][1].set_title("time ÷ unguarded or plain SDK (dashed: target 1.15, dotted: 1.05)")
    figure.tight_layout()
    figure.savefig(path)
    return f"plot written to {path}"


# --- command line ------------------------------------------------------------------------------------------------


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `commitgate bench` to the CLI's subcommands."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure safety (duplicate effects under faults) and cost (time per call) against real server"
        " processes",
    )
    parser.add_argument("--quick", action="store_true", help="everything small (under a minute)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the figures (needs matplotlib)")
    parser.add_argument(
        "--only", metavar="SECTION,...", help=f"run only these sections, of: {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=7,
        help="random seed of the bench client, for repeatable runs (default: 7)",
    )
    parser.set_defaults(func=cmd_bench)
    return parser


def options_from(args: argparse.Namespace) -> Options:
    only = SECTIONS
    if args.only:
        only = tuple(s.strip() for s in args.only.split(",") if s.strip())
        unknown = [s for s in only if s not in SECTIONS]
        if unknown:
            raise SystemExit(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    return Options(
        quick=args.quick,
        json_path=Path(args.json) if args.json else None,
        plot_path=Path(args.plot) if args.plot else None,
        only=only,
        seed=args.seed,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    options = options_from(args)
    results = asyncio.run(run_bench(options))
    if options.json_path is not None:
        options.json_path.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(results["checks"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commitgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
