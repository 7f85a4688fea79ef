"""Helpers for the HTTP transport tests: policies, real server processes on free ports, MCP clients."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

TOKENS = {
    "alice": "alice-token-5b1c9e0f2d7a4c83",
    "bob": "bob-token-0e6f3a9d8c2b7e41",
    "ops": "ops-token-3c8e1a7f5d0b9e26",  # an operator's: /metrics, never MCP
}
TOKEN_ENV = "CG_TEST_TOKEN_ALICE"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0

TOOLS = """
[tools.get_balance]
class = "safe-retry"
python = "commitgate.server.demo.tools:get_balance"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
timeout = "10s"

[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"

[tools.slow_task]
class = "key-required"
python = "commitgate.server.demo.tools:slow_task"
timeout = "60s"
"""

# A task that waits for a gate file the test creates (tests/tools_e2e/gated.py): the test, not a
# sleep, decides how long it stays in flight. The server needs GATED_ENV to import it.
GATED_TOOL = """
[tools.gated_task]
class = "key-required"
python = "tools_e2e.gated:gated_task"
timeout = "60s"
"""
GATED_ENV = {
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")])
    )
}


def token_entry(principal: str, token: str) -> str:
    return f'[[auth.tokens]]\nprincipal = "{principal}"\ntoken_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'


def auth_section(extra: dict[str, str] | None = None) -> str:
    entries = [
        f'[[auth.tokens]]\nprincipal = "alice"\ntoken_env = "{TOKEN_ENV}"\n',
        token_entry("bob", TOKENS["bob"]),
        token_entry("ops", TOKENS["ops"]) + 'role = "operator"\n',
    ]
    entries += [token_entry(principal, token) for principal, token in (extra or {}).items()]
    return "\n".join(entries)


def write_policy(
    directory: Path,
    *,
    auth: bool = True,
    max_argument_bytes: int = 4000,
    list_limit: int = 20,
    max_concurrent_per_principal: int = 8,
    name: str = "policy.toml",
    extra_tokens: dict[str, str] | None = None,
    extra_tools: str = "",
) -> Path:
    text = f"""
[server]
name = "commitgate-http-test"
lease = "3s"
respond_within = "20s"
in_progress_wait = "10s"

[server.limits]
max_argument_bytes = {max_argument_bytes}
list_limit = {list_limit}
max_concurrent_per_principal = {max_concurrent_per_principal}

[ledger]
synchronous = "NORMAL"

{auth_section(extra_tokens) if auth else ""}
{TOOLS}
{extra_tools}
"""
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_argv(args: Sequence[str], preamble: str = "") -> list[str]:
    """`commitgate serve ARGS`; with `preamble`, Python run in the server process before the CLI."""
    if not preamble:
        return [sys.executable, "-m", "commitgate.server.cli", "serve", *args]
    script = f"{preamble}\nimport sys\nfrom commitgate.server.cli.main import main\nsys.exit(main())"
    return [sys.executable, "-c", script, "serve", *args]


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    port: int
    transport: str
    stderr_path: Path
    host: str = "127.0.0.1"
    _stderr: Any = field(default=None, repr=False)
    _signalled: bool = field(default=False, repr=False)

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return self.base + ("/mcp" if self.transport == "streamable-http" else "/sse")

    def stderr(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8", errors="replace")

    def send(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` once: a second SIGINT would make uvicorn skip its graceful shutdown."""
        if self.proc.poll() is None and not self._signalled:
            self.proc.send_signal(sig)
            self._signalled = True

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.send(sig)
        if self.proc.poll() is None:
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._stderr is not None:
            self._stderr.close()
        return int(self.proc.returncode)


def server_env(sandbox: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"COMMITGATE_SANDBOX": str(sandbox), TOKEN_ENV: TOKENS["alice"], "PYTHONUNBUFFERED": "1"})
    env.pop("COMMITGATE_SANDBOX_FAULTS", None)
    env.update(extra or {})
    return env


def start_server(
    workdir: Path,
    policy: Path,
    transport: str,
    *,
    ledger: Path | str,  # a SQLite file, or a ledger URL (PostgreSQL)
    sandbox: Path,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_level: str = "info",
    port: int | None = None,
    wait: bool = True,
    preamble: str = "",
) -> Served:
    port = port or free_port()
    argv = server_argv(
        [
            "--transport", transport, "--host", "127.0.0.1", "--port", str(port), "--policy", str(policy),
            "--ledger", ledger if isinstance(ledger, str) else f"sqlite:///{ledger}", "--log-level", log_level, *args,
        ],
        preamble,
    )  # fmt: skip
    stderr_path = workdir / f"server-{transport}-{port}.stderr"
    stderr = stderr_path.open("wb")
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=server_env(sandbox, env)
    )
    served = Served(proc, port, transport, stderr_path, _stderr=stderr)
    if wait:
        wait_ready(served)
    return served


def wait_ready(served: Served) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if served.proc.poll() is not None:
            raise RuntimeError(f"server exited with {served.proc.returncode}:\n{served.stderr()[-3000:]}")
        with contextlib.suppress(httpx2.HTTPError):
            if httpx2.get(served.base + "/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    served.stop()
    raise RuntimeError(f"server did not become ready:\n{served.stderr()[-3000:]}")


@contextlib.contextmanager
def running(*args: Any, **kwargs: Any) -> Iterator[Served]:
    served = start_server(*args, **kwargs)
    try:
        yield served
    finally:
        served.stop()


@contextlib.contextmanager
def running_together(*starts: dict[str, Any]) -> Iterator[list[Served]]:
    """Several servers (`start_server` keyword arguments each), started at once: their imports
    overlap instead of queueing one after another."""
    servers: list[Served] = []
    try:
        for start in starts:
            servers.append(start_server(**start, wait=False))
        for served in servers:
            wait_ready(served)
        yield servers
    finally:
        for served in servers:
            served.send()  # they stop at once too
        for served in servers:
            served.stop()


def bearer(principal: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[principal]}"} if principal else {}


@contextlib.asynccontextmanager
async def connect(
    served: Served,
    principal: str | None = "alice",
    mode: str = "auto",
    *,
    headers: dict[str, str] | None = None,
    transport: httpx2.AsyncBaseTransport | None = None,
) -> AsyncIterator[Client]:
    """An SDK client of `served` with `principal`'s token (None: no token), in `mode`."""
    sent = headers if headers is not None else bearer(principal)
    if served.transport == "sse":
        async with Client(sse_client(served.endpoint, headers=sent), mode=mode) as client:
            yield client
        return
    timeout = httpx2.Timeout(30, read=300)
    async with (
        httpx2.AsyncClient(headers=sent, timeout=timeout, transport=transport) as http,
        Client(streamable_http_client(served.endpoint, http_client=http), mode=mode) as client,
    ):
        yield client


class RoundRobin(httpx2.AsyncBaseTransport):
    """A load balancer in miniature: each HTTP request goes to the next port in turn."""

    def __init__(self, ports: Sequence[int]) -> None:
        self._ports = itertools.cycle(ports)
        self._inner = httpx2.AsyncHTTPTransport()
        self.sent: list[int] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        port = next(self._ports)
        self.sent.append(port)
        request.url = request.url.copy_with(port=port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def error_code(result: Any) -> str | None:
    if not result.is_error:
        return None
    return str(((result.structured_content or {}).get("error") or {}).get("code"))


def operation_of(result: Any) -> dict[str, Any]:
    return dict((result.meta or {}).get("commitgate/operation") or {})
