"""Cost under load: many agents calling at once over streamable HTTP, guarded beside a plain SDK server.

Two servers listen on loopback: `commitgate serve --transport streamable-http` with a key-required
no-op on a durable ledger (`synchronous = FULL`, every call with a new key), and a plain MCP SDK
server's async no-op (`python -m commitgate.server.bench.plain_sdk --http PORT`). For each concurrency
the bench opens that many MCP sessions to each server (each a `Client` of its own, with its own HTTP
connection, all in this one process) and runs rounds: in each round, in a fresh random order, every
session of one server makes its calls back to back while the others wait, then the other server's.
Per round it takes each server's calls per second (calls ÷ wall time of its block) and every call's
latency; the ratio is paired per round, the p99 pooled over the rounds.

Beside them it reads, from /proc, the CPU time this client process and each server process used in
the blocks: a server using about a whole core is bound by its own Python; a client using more than the
server it calls bounds that server's figure rather than the server does. Each server's CPU is split by
thread (the event loop, the ledger's writer, its checkpointer, the rest), and its context switches and
read/write system calls are counted per call.

After the timed rounds, an untimed block at the concurrency where the guarded server fell shortest
says what bounds it: `strace -c` attached to each server for a while counts its system calls per call
(syncs, reads, writes, epoll waits, futex wake-ups), then a fresh pair of servers runs under py-spy
and their samples are reduced to shares by room (HTTP transport, MCP surface, commit boundary,
ledger, receipts). Either step, when its tool is missing or may not run, says so and is left out.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from commitgate.server.bench import profile, syscalls
from commitgate.server.bench.procstat import Tally, sample
from commitgate.server.bench.stats import quantile, spread
from commitgate.server.bench.workspace import Bench, BenchError, cpu_seconds, operation_of

LOAD_POLICY = """
# A key-required no-op on a durable ledger: each call claims a new operation and records its outcome.
[server]
name = "commitgate-bench-load"
[server.limits]
max_concurrent_per_principal = 1000
[ledger]
synchronous = "FULL"
[tools.noop_keyed]
class = "key-required"
python = "commitgate.server.bench.tools:noop"
retry = { attempts = 1 }
"""
READY_TIMEOUT = 60.0
SERVERS = ("plain_sdk", "guarded")
_FRESH = itertools.count(random.randrange(1 << 40))  # arguments never seen before, run after run


@dataclass
class _Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    tool: str
    keyed: bool
    rates: list[float] = field(default_factory=list)  # calls per second, one per round
    latencies: list[float] = field(default_factory=list)  # ms, every call of every round
    pid: int = 0  # the server process (py-spy's child when profiled)
    cpu_s: float = 0.0  # the server process's CPU time in its blocks
    client_cpu_s: float = 0.0  # this process's CPU time in the server's blocks
    wall_s: float = 0.0
    calls: int = 0
    tally: Tally = field(default_factory=Tally)  # its threads' CPU and its counters in its blocks

    def reset(self) -> None:
        self.rates, self.latencies = [], []
        self.cpu_s = self.client_cpu_s = self.wall_s = 0.0
        self.calls = 0
        self.tally = Tally()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"a load server exited with status {proc.returncode} (see the servers' log)")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.05)
    raise BenchError(f"a load server did not listen on port {port} within {READY_TIMEOUT:.0f} s")


@contextlib.contextmanager
def _servers(
    bench: Bench, ledger: str = "load", wrap: Callable[[str], list[str]] | None = None
) -> Iterator[dict[str, _Server]]:
    """The plain SDK server and the guarded commitgate server, both on loopback, started at once;
    `wrap(name)` is a command each runs under (py-spy), the server being that command's child."""
    policy = bench.policy("load", LOAD_POLICY)
    ports = {name: _free_port() for name in SERVERS}
    argv = {
        "plain_sdk": [sys.executable, "-m", "commitgate.server.bench.plain_sdk", "--http", str(ports["plain_sdk"])],
        "guarded": [
            sys.executable, "-m", "commitgate.server.cli", "serve", "--transport", "streamable-http",
            "--host", "127.0.0.1", "--port", str(ports["guarded"]), "--policy", str(policy),
            "--ledger", f"sqlite:///{bench.ledger(ledger)}",
        ],
    }  # fmt: skip
    env = {**os.environ, **bench.box.env}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    pids: dict[str, int] = {}
    try:
        for name in SERVERS:
            procs[name] = subprocess.Popen(
                [*(wrap(name) if wrap else []), *argv[name]],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=bench.log, env=env,
            )  # fmt: skip
        for name in SERVERS:
            _wait_listening(procs[name], ports[name])
            pids[name] = _child_of(procs[name].pid) if wrap else procs[name].pid
        yield {
            name: _Server(
                name,
                procs[name],
                f"http://127.0.0.1:{ports[name]}/mcp",
                "noop_keyed" if name == "guarded" else "noop",
                keyed=name == "guarded",
                pid=pids[name],
            )
            for name in SERVERS
        }
    finally:
        for name, proc in procs.items():  # a wrapper ends (and writes its profile) when its server does
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids.get(name, proc.pid), signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _child_of(pid: int) -> int:
    """The one child process of `pid` (a server started by its wrapper)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                return int(stat.parent.name)
    raise BenchError(f"no server process found under process {pid}")


@contextlib.asynccontextmanager
async def _sessions(url: str, count: int) -> AsyncIterator[list[Client]]:
    """`count` MCP sessions of `url`, each with an HTTP connection of its own, opened at once; each
    lives in a task of its own (a client is left in the task that entered it)."""
    clients: list[Client] = []
    opened, done = anyio.Event(), anyio.Event()

    async def hold() -> None:
        timeout = httpx2.Timeout(60, read=300)
        async with (
            httpx2.AsyncClient(timeout=timeout) as http,
            Client(streamable_http_client(url, http_client=http), read_timeout_seconds=120) as client,
        ):
            clients.append(client)
            if len(clients) == count:
                opened.set()
            await done.wait()

    async with anyio.create_task_group() as group:
        for _ in range(count):
            group.start_soon(hold)
        await opened.wait()
        try:
            yield list(clients)
        finally:
            done.set()


async def _call(server: _Server, client: Client, key: str) -> None:
    """One call; a keyed server's with a new key and arguments of their own (else a possible duplicate)."""
    arguments: dict[str, Any] = {"n": next(_FRESH)}
    if server.keyed:
        arguments["idempotency_key"] = key
    result = await client.call_tool(server.tool, arguments)
    if result.is_error:
        raise BenchError(f"{server.name}: {result.content}")
    if server.keyed and operation_of(result).get("replayed") is not False:
        raise BenchError(f"{server.name}: expected a new operation, got {result.meta}")


async def _block(server: _Server, clients: list[Client], calls_each: int, run: str) -> None:
    """Every session of `server` makes `calls_each` calls back to back, all sessions at once."""
    latencies: list[float] = []

    async def session(index: int, client: Client) -> None:
        for i in range(calls_each):
            start = time.perf_counter_ns()
            await _call(server, client, f"{run}-{index}-{i}")
            latencies.append((time.perf_counter_ns() - start) / 1e6)

    before = sample(server.pid)
    cpu_server, cpu_client = cpu_seconds(server.pid) or 0.0, cpu_seconds(os.getpid()) or 0.0
    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for index, client in enumerate(clients):
            group.start_soon(session, index, client)
    wall = time.perf_counter() - start
    server.cpu_s += (cpu_seconds(server.pid) or 0.0) - cpu_server
    server.client_cpu_s += (cpu_seconds(os.getpid()) or 0.0) - cpu_client
    server.tally.add(before, sample(server.pid))
    server.wall_s += wall
    server.calls += len(latencies)
    server.rates.append(len(latencies) / wall)
    server.latencies += latencies


async def _drive(server: _Server, clients: list[Client], seconds: float, run: str) -> int:
    """Every session of `server` calls back to back for `seconds`; the number of calls made."""
    deadline, made = time.monotonic() + seconds, [0]

    async def session(index: int, client: Client) -> None:
        while time.monotonic() < deadline:
            await _call(server, client, f"{run}-{index}-{made[0]}")
            made[0] += 1

    async with anyio.create_task_group() as group:
        for index, client in enumerate(clients):
            group.start_soon(session, index, client)
    return made[0]


async def _at_concurrency(
    bench: Bench, servers: dict[str, _Server], sessions: int, tick: Callable[[int], None]
) -> dict[str, Any]:
    scale = bench.scale
    calls_each = max(2, scale.load_calls_per_round // sessions)
    for server in servers.values():
        server.reset()
    async with (
        _sessions(servers["plain_sdk"].url, sessions) as plain,
        _sessions(servers["guarded"].url, sessions) as guarded,
    ):
        clients = {"plain_sdk": plain, "guarded": guarded}
        run = uuid.uuid4().hex[:8]
        for name, server in servers.items():  # warm up: every session once, not timed
            await _block(server, clients[name], 1, f"{run}-warm")
            server.reset()
        for round_no in range(scale.load_rounds):
            order = list(SERVERS)
            random.shuffle(order)
            for name in order:
                await _block(servers[name], clients[name], calls_each, f"{run}-{round_no}")
            tick(1)
    plain_s, guarded_s = servers["plain_sdk"], servers["guarded"]
    return {
        "sessions": sessions,
        "calls_per_session_per_round": calls_each,
        "rounds": scale.load_rounds,
        "per_server": {name: _figures(server) for name, server in servers.items()},
        "guarded_over_plain": spread([g / p for g, p in zip(guarded_s.rates, plain_s.rates, strict=True)]),
    }


def _figures(server: _Server) -> dict[str, Any]:
    ordered = sorted(server.latencies)
    wall = server.wall_s or 1.0
    return {
        "calls_per_s": round(statistics.median(server.rates), 1),
        "p50_ms": round(quantile(ordered, 0.5), 2),
        "p99_ms": round(quantile(ordered, 0.99), 2),
        "calls": server.calls,
        # cores busy while its blocks ran: 1.0 is one core all the time
        "server_cpu_cores": round(server.cpu_s / wall, 2),
        "client_cpu_cores": round(server.client_cpu_s / wall, 2),
        "server_cpu_us_per_call": round(server.cpu_s / max(1, server.calls) * 1e6, 1),
        "client_cpu_us_per_call": round(server.client_cpu_s / max(1, server.calls) * 1e6, 1),
        **server.tally.figures(wall, server.calls),
    }


async def load(bench: Bench) -> dict[str, Any]:
    """Throughput and p99 of guarded durable calls beside a plain SDK server's, at each concurrency;
    then, untimed, what bounds the guarded server where it fell shortest."""
    levels = bench.scale.load_sessions
    tick = bench.task("cost under load", len(levels) * bench.scale.load_rounds + 2)
    with _servers(bench) as servers:
        by_level = [await _at_concurrency(bench, servers, sessions, tick) for sessions in levels]
        recorded = _succeeded(bench.ledger("load"))
        worst = min(by_level, key=lambda level: level["guarded_over_plain"]["median"])["sessions"]
        counted = await _syscalls(bench, servers, worst)
        tick(1)
    profiled = await _profiles(bench, worst)
    tick(1)
    return {
        "transport": "streamable HTTP on loopback, one client process, each session its own MCP session",
        "guarded": "commitgate serve, key-required no-op, a new key per call, synchronous = FULL",
        "plain_sdk": "MCP SDK MCPServer, async no-op tool (python -m commitgate.server.bench.plain_sdk --http)",
        "levels": by_level,
        # every guarded call of the timed rounds, warm-up included, is one operation its server recorded
        "guarded_operations_succeeded": recorded,
        "bounds": {
            "sessions": worst,
            "seconds_per_server": bench.scale.load_bounds_s,
            "syscalls_per_call": counted,
            "profile": profiled,
        },
    }


async def _syscalls(bench: Bench, servers: dict[str, _Server], sessions: int) -> dict[str, Any]:
    """Each server's system calls per call, counted by strace attached while `sessions` sessions call it."""
    out: dict[str, Any] = {}
    async with (
        _sessions(servers["plain_sdk"].url, sessions) as plain,
        _sessions(servers["guarded"].url, sessions) as guarded,
    ):
        clients, run = {"plain_sdk": plain, "guarded": guarded}, uuid.uuid4().hex[:8]
        for name, server in servers.items():
            table = bench.root / f"strace-{name}.txt"
            try:
                with syscalls.counted(server.pid, table):
                    calls = await _drive(server, clients[name], bench.scale.load_bounds_s, f"{run}-strace")
            except OSError as exc:
                return {"note": f"system calls not counted: {exc}"}
            out[name] = syscalls.per_call(syscalls.summary_counts(table.read_text()), calls)
    return out


async def _profiles(bench: Bench, sessions: int) -> dict[str, Any]:
    """Each server's samples by room, from a fresh pair of servers run under py-spy at `sessions` sessions."""
    spy = profile.py_spy()
    if spy is None:
        return {"note": "no profile: py-spy is not installed (pip install py-spy, or commitgate[bench])"}
    outs = {name: bench.root / f"profile-{name}.txt" for name in SERVERS}
    try:
        with _servers(bench, "load-profile", lambda name: profile.record_argv(spy, outs[name])) as servers:
            async with (
                _sessions(servers["plain_sdk"].url, sessions) as plain,
                _sessions(servers["guarded"].url, sessions) as guarded,
            ):
                clients, run = {"plain_sdk": plain, "guarded": guarded}, uuid.uuid4().hex[:8]
                for name, server in servers.items():
                    await _drive(server, clients[name], bench.scale.load_bounds_s, f"{run}-profile")
    except BenchError as exc:
        return {"note": f"no profile: py-spy could not run the servers ({exc})"}
    if not all(path.exists() for path in outs.values()):
        return {"note": "no profile: py-spy wrote none (see the bench log)"}
    return {name: profile.shares(path.read_text().splitlines()) for name, path in outs.items()}


def _succeeded(ledger: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT count(*) FROM operations WHERE state = 'SUCCEEDED'").fetchone()[0])
