"""End-to-end helpers: a policy in a directory, real `commitgate serve` processes over stdio, and counting.

A `Deployment` is one directory holding a policy file, a ledger file and a
sandbox store; any number of server processes may serve it at once (they share
the ledger, as several processes on one host do). `serve()` starts one such
process behind an SDK `Client` and can `kill -9` it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import CallToolResult, RequestParamsMeta, TextContent

from commitgate.server.demo import tools as demo

TESTS_DIR = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = Path(sys.executable).parent / "commitgate"

SESSION_META = "commitgate/session"
STEP_META = "commitgate/step"
OPERATION_META = "commitgate/operation"
TAG_ENV = "COMMITGATE_E2E_TAG"  # marks each server process so a test can find (and kill) it

# Fast retries so failure paths take milliseconds; timeouts well above any healthy call.
TOOLS_TOML = """
[tools.get_balance]
class = "safe-retry"
python = "commitgate.server.demo.tools:get_balance"
retry = { attempts = 3, initial = "10ms", max = "50ms" }

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
timeout = "10s"
retry = { attempts = 3, initial = "10ms", max = "50ms" }

[tools.send_email]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
timeout = "10s"
retry = { attempts = 3, initial = "10ms", max = "50ms" }

[tools.gated_task]
class = "key-required"
python = "tools_e2e.gated:gated_task"
timeout = "60s"
description = "Wait for a gate file, then record a task."
"""


def policy_toml(
    *,
    principal: str | None = None,
    lease: str = "2s",
    respond_within: str = "1500ms",
    in_progress_wait: str = "1s",
    max_argument_bytes: int | None = None,
    max_concurrent_per_principal: int | None = None,
) -> str:
    principal_line = f'principal = "{principal}"\n' if principal else ""
    limits = "".join(
        f"{name} = {value}\n"
        for name, value in (
            ("max_argument_bytes", max_argument_bytes),
            ("max_concurrent_per_principal", max_concurrent_per_principal),
        )
        if value
    )
    limits = f"\n[server.limits]\n{limits}" if limits else ""
    server = (
        "[server]\n"
        'name = "commitgate-e2e"\n'
        f"{principal_line}"
        f'lease = "{lease}"\n'
        f'respond_within = "{respond_within}"\n'
        f'in_progress_wait = "{in_progress_wait}"\n'
    )
    return server + limits + '\n[ledger]\nsynchronous = "FULL"\n' + TOOLS_TOML


@dataclass
class Deployment:
    """A policy, a ledger and a sandbox in one directory."""

    root: Path
    policy: Path
    ledger: Path
    sandbox: Path

    @classmethod
    def create(cls, root: Path, name: str = "policy.toml", **policy_options: Any) -> Deployment:
        root.mkdir(parents=True, exist_ok=True)
        policy = root / name
        policy.write_text(policy_toml(**policy_options), encoding="utf-8")
        return cls(root, policy, root / "ledger.db", root / "sandbox.db")

    def with_policy(self, name: str, **policy_options: Any) -> Deployment:
        """Another policy file on the same ledger and sandbox (e.g. another principal)."""
        policy = self.root / name
        policy.write_text(policy_toml(**policy_options), encoding="utf-8")
        return Deployment(self.root, policy, self.ledger, self.sandbox)

    def env(self, faults: str = "", tag: str = "") -> dict[str, str]:
        return {
            demo.ENV_PATH: str(self.sandbox),
            demo.ENV_FAULTS: faults,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(TESTS_DIR),  # makes `tools_e2e` importable by the server
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", str(self.root)),
            TAG_ENV: tag,
        }

    def params(self, faults: str = "", tag: str = "") -> StdioServerParameters:
        args = ["serve", "--policy", str(self.policy), "--ledger", f"sqlite:///{self.ledger}"]
        return StdioServerParameters(command=str(CONSOLE_SCRIPT), args=args, env=self.env(faults, tag))

    def count(self, table: str, **where: Any) -> int:
        """Rows of a sandbox table (the system of record) matching `where`."""
        with _sandbox(self.sandbox):
            return demo.count(table, **where)

    def rows(self, table: str, **where: Any) -> list[dict[str, Any]]:
        with _sandbox(self.sandbox):
            return demo.rows(table, **where)

    def fault_remaining(self, tool: str, kind: str) -> int:
        """What is left of an integer fault budget: tells how many attempts the tool saw."""
        (row,) = self.rows("faults", tool=tool, kind=kind)
        return int(row["remaining"])


@contextlib.contextmanager
def _sandbox(path: Path) -> Iterator[None]:
    previous = os.environ.get(demo.ENV_PATH)
    os.environ[demo.ENV_PATH] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(demo.ENV_PATH, None)
        else:
            os.environ[demo.ENV_PATH] = previous


@dataclass
class Server:
    """One running `commitgate serve` process and the client connected to it."""

    client: Client
    deployment: Deployment
    tag: str
    stderr: Path
    _pid: int | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        if self._pid is None:
            self._pid = find_pid(self.tag)
        return self._pid

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    async def call(
        self,
        tool: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        session: str | None = None,
        step: str | None = None,
    ) -> CallToolResult:
        meta: dict[str, Any] = {}
        if session is not None:
            meta[SESSION_META] = session
        if step is not None:
            meta[STEP_META] = step
        return await self.client.call_tool(tool, dict(arguments or {}), meta=as_meta(meta) if meta else None)

    async def status(self, meta_session: str | None, /, **arguments: Any) -> dict[str, Any]:
        """get_operation_status with `arguments`, sent with `meta_session` in `_meta` (if not None)."""
        result = await self.call("get_operation_status", arguments, session=meta_session)
        assert not result.is_error, result.content
        assert result.structured_content is not None
        return result.structured_content

    async def operations(self, **arguments: Any) -> list[dict[str, Any]]:
        """list_operations with `arguments` (its `session` is an argument, not `_meta`)."""
        result = await self.call("list_operations", arguments)
        assert not result.is_error, result.content
        assert result.structured_content is not None
        return list(result.structured_content["operations"])

    async def wait_for_state(
        self, session: str, key: str, states: set[str], within: float = 15.0
    ) -> dict[str, Any]:
        """Poll get_operation_status until the operation reaches one of `states` (fails after `within` s)."""
        with anyio.fail_after(within):
            while True:
                answer = await self.status(session, idempotency_key=key)
                if answer["found"] and answer["operation"]["state"] in states:
                    return dict(answer["operation"])
                await anyio.sleep(0.05)


def text_of(result: CallToolResult, index: int = 0) -> str:
    """The text of a result's content block (failing clearly when it is not text)."""
    block = result.content[index]
    assert isinstance(block, TextContent), block
    return block.text


def as_meta(values: Mapping[str, Any]) -> RequestParamsMeta:
    """Our `_meta` keys as the SDK's request-meta type (a TypedDict that allows namespaced extras)."""
    return cast(RequestParamsMeta, dict(values))


def find_pid(tag: str) -> int:
    """The pid of the server process whose environment carries `tag` (Linux /proc)."""
    marker = f"{TAG_ENV}={tag}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if marker in environ.read_bytes().split(b"\0"):
                return int(environ.parent.name)
    raise LookupError(f"no server process tagged {tag}")


@contextlib.asynccontextmanager
async def serve(
    deployment: Deployment,
    *,
    mode: str = "auto",
    faults: str = "",
    read_timeout: float = 30.0,
    elicitation_callback: Any = None,
    env: Mapping[str, str] | None = None,
    ledger: str | None = None,
    stdio: str = "fast",
) -> AsyncIterator[Server]:
    """Start `commitgate serve --stdio <stdio>` on the deployment and connect a client to it (`mode`:
    "auto" or "legacy").

    `elicitation_callback`: the client declares elicitation and answers with it (a person, in tests)."""
    tag = uuid.uuid4().hex
    log = deployment.root / f"server-{tag[:8]}.stderr"
    with log.open("w", encoding="utf-8") as errlog:
        params = deployment.params(faults, tag)
        if ledger is not None:  # another ledger than the deployment's file (e.g. PostgreSQL)
            params.args = [*params.args[:-1], ledger]
        if env:
            params.env = {**(params.env or {}), **env}
        params.args = [*params.args, "--stdio", stdio]
        transport = stdio_client(params, errlog=errlog)
        options: dict[str, Any] = (
            {"elicitation_callback": elicitation_callback} if elicitation_callback else {}
        )
        try:
            async with Client(transport, mode=mode, read_timeout_seconds=read_timeout, **options) as client:
                yield Server(client, deployment, tag, log)
        except BaseException:
            errlog.flush()
            sys.stderr.write(f"--- stderr of server {tag[:8]} ---\n{log.read_text(encoding='utf-8')}\n")
            raise


T = TypeVar("T")


@contextlib.asynccontextmanager
async def together(*contexts: AbstractAsyncContextManager[T]) -> AsyncIterator[list[T]]:
    """Enter `contexts` at once, so server processes start side by side rather than one after another.

    Each context opens and closes in a task of its own (anyio wants both in one task); the body runs
    in the caller's task, and its own exception comes out as it is, not in a group."""
    entered: dict[int, T] = {}
    ready = [anyio.Event() for _ in contexts]
    stop = anyio.Event()

    async def hold(index: int, context: AbstractAsyncContextManager[T]) -> None:
        async with context as value:
            entered[index] = value
            ready[index].set()
            await stop.wait()

    try:
        async with anyio.create_task_group() as tasks:
            for index, context in enumerate(contexts):
                tasks.start_soon(hold, index, context)
            for event in ready:
                await event.wait()
            try:
                yield [entered[index] for index in range(len(contexts))]
            finally:
                stop.set()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def run_together(
    *commands: list[str], env: Mapping[str, str] | None = None, timeout: float = 60
) -> list[subprocess.CompletedProcess[str]]:
    """`subprocess.run` of each command, side by side: CLI processes start in parallel."""
    started = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for command in commands
    ]
    finished = []
    for command, process in zip(commands, started, strict=True):
        stdout, stderr = process.communicate(timeout=timeout)
        finished.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    return finished


def operation(result: CallToolResult) -> dict[str, Any]:
    """`_meta["commitgate/operation"]` of a result (empty if absent)."""
    return dict((result.meta or {}).get(OPERATION_META) or {})


def error(result: CallToolResult) -> dict[str, Any]:
    """The `structuredContent.error` of an error result."""
    assert result.is_error, f"expected an error, got {result.structured_content}"
    assert result.structured_content is not None
    return dict(result.structured_content["error"])


def error_code(result: CallToolResult) -> str | None:
    return str(error(result)["code"]) if result.is_error else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
