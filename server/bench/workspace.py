"""The bench's workspace: its scale, a sandbox store, policies, server processes and clients.

Every section of `commitgate bench` runs in one `Bench`: a temporary directory holding the demo
sandbox store (the system of record whose rows the experiments count), the policy and ledger
files, and the log the servers' stderr goes to; it starts real `commitgate serve` processes and
connects to them with the SDK's `Client`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar, cast

import anyio
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import CallToolResult, RequestParamsMeta
from rich.progress import Progress

from commitgate.server.demo.sandbox import server_pids
from commitgate.server.model.facts import OPERATION_META, SESSION_META

K = TypeVar("K", bound=Hashable)


class BenchError(Exception):
    """Something the benchmark relies on did not happen (a crashed server, an unexpected answer)."""


@dataclass(frozen=True, slots=True)
class Scale:
    """How much each section does: FULL by default, QUICK with `--quick`."""

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
    warm_up_calls: int = 50  # per server before the timed rounds; the replays' keys are among them
    sync_samples: int = 400  # commits per mode timed for what a durable commit's sync costs
    quiet_s: float = 0.5  # how long the ledgers' directory must be still before the idle floors
    ledger_ops: int = 10_000
    memory_rows: int = 1_000_000
    startups: int = 7
    load_sessions: tuple[int, ...] = (8, 32, 64)  # concurrent MCP sessions per server, over HTTP
    load_rounds: int = 5
    load_calls_per_round: int = 640  # per server and round, shared among its sessions
    load_bounds_s: float = 5.0  # per server, after the timed rounds: counting system calls, then profiling


FULL = Scale()
# Every section and figure of the full run from as few real measurements as still give them: a
# smoke test of the bench, not figures to compare. The safety experiments keep enough calls that a
# run without a single injected fault (each fires at random) is a one-in-a-million event.
QUICK = Scale(
    bookings=24,
    orders=40,
    retriers=20,
    capacity=4,
    median_ms=50.0,
    p99_ms=500.0,
    dup_keys=8,
    dup_copies=16,
    processes=2,
    tool_latency=0.02,
    rounds=2,
    calls_per_round=10,
    warm_up_calls=10,
    sync_samples=100,
    quiet_s=0.0,
    ledger_ops=128,
    memory_rows=10_000,
    startups=1,
    load_sessions=(2, 4),
    load_rounds=2,
    load_calls_per_round=16,
    load_bounds_s=1.0,
)

# --- calls and processes ---------------------------------------------------------------------------------


def session_meta(session: str) -> RequestParamsMeta:
    """The request `_meta` that names commitgate's session (an open map in the SDK's types)."""
    return cast(RequestParamsMeta, {SESSION_META: session})


def operation_of(result: CallToolResult) -> dict[str, Any]:
    return dict((result.meta or {}).get(OPERATION_META) or {})


def error_code(result: CallToolResult) -> str | None:
    if not result.is_error:
        return None
    return str((result.structured_content or {}).get("error", {}).get("code"))


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
            command=sys.executable, args=["-m", "commitgate.server.bench.plain_sdk"], env=self.box.env
        )

    @contextlib.asynccontextmanager
    async def connect(self, params: StdioServerParameters, timeout: float = 120.0) -> AsyncIterator[Client]:
        """A real MCP client over stdio; the server's stderr goes to the bench log, not the progress bars."""
        async with Client(stdio_client(params, errlog=self.log), read_timeout_seconds=timeout) as client:
            yield client

    @contextlib.asynccontextmanager
    async def connect_all(self, params: Mapping[K, StdioServerParameters]) -> AsyncIterator[dict[K, Client]]:
        """Clients of several servers, started at once and stopped at once: a start is mostly an
        interpreter importing its modules, which the machine's other cores can do meanwhile.

        Each client lives in a task of its own (a client is left in the task that entered it);
        calls may come from any task."""
        clients: dict[K, Client] = {}
        connected, done = anyio.Event(), anyio.Event()

        async def hold(name: K, server: StdioServerParameters) -> None:
            async with self.connect(server) as client:
                clients[name] = client
                if len(clients) == len(params):
                    connected.set()
                await done.wait()

        async with anyio.create_task_group() as group:
            for name, server in params.items():
                group.start_soon(hold, name, server)
            await connected.wait()
            try:
                yield {name: clients[name] for name in params}  # in the order asked
            finally:
                done.set()

    def server_pid(self, ledger: Path) -> int:
        """The process serving from `ledger` (each server of the bench has a ledger of its own)."""
        pids = server_pids(str(ledger))
        if not pids:
            raise BenchError(f"no server process found for {ledger}")
        return pids[0]

    def task(self, description: str, total: int) -> Callable[[int], None]:
        task_id = self.progress.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            self.progress.advance(task_id, n)

        return advance
