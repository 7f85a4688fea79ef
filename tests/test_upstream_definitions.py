"""A wrapped tool is advertised with its upstream's own definition from the first `tools/list`.

`policy init` records what each server listed in the ledger of the policy it writes; `serve` keeps
that current at each connect and, until an upstream has connected, advertises its tools as last
listed. Real processes throughout: the upstream (tests/support/upstream_server.py over streamable
HTTP), `commitgate serve` over stdio, an MCP client; SQLite, and PostgreSQL for replicas.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from support.http_servers import free_port
from support.postgres import fresh_url
from support.wrapping import TESTS_DIR, base_env, eventually, text

from commitgate.server.ledger import open_ledger
from commitgate.server.ledger.base import LedgerUnavailable

pytestmark = pytest.mark.anyio

UPSTREAM = TESTS_DIR / "support" / "upstream_server.py"
DESCRIPTION = "Record a note (the side effect)."
LATE = 8.0  # seconds the upstream takes to come up
CHANGED = "notifications/tools/list_changed"
NOTE_SCHEMA = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}


@contextlib.contextmanager
def upstream(port: int, effects: Path, gate: Path | None = None) -> Iterator[None]:
    """The stub upstream on `port`; with `gate`, it listens only once that file exists."""
    env = {**os.environ, "STUB_LOG": str(effects), **({"STUB_GATE": str(gate)} if gate else {})}
    process = subprocess.Popen(
        [sys.executable, str(UPSTREAM), "http", str(port)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        if gate is None:
            assert process.stdout is not None and process.stdout.readline().startswith("http://")
        yield
    finally:
        process.terminate()
        process.wait(timeout=15)


async def listening(port: int, within: float = 30.0) -> None:
    """Once the upstream on `port` accepts connections (a loaded machine may take seconds)."""
    deadline = time.monotonic() + within
    while True:
        try:
            stream = await anyio.connect_tcp("127.0.0.1", port)
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on port {port} after {within:.0f}s"
            await anyio.sleep(0.1)
        else:
            await stream.aclose()
            return


@dataclass
class Served:
    client: Client
    log: Path
    notifications: list[str] = field(default_factory=list)

    def logged(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.asynccontextmanager
async def serving(policy: Path, log: Path, env: dict[str, str]) -> AsyncIterator[Served]:
    """`commitgate serve --policy POLICY` over stdio, behind a handshake-era client that keeps the
    methods of the notifications it receives."""
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "commitgate.server.cli", "serve", "--policy", str(policy), "--log-level", "info"],
        env=base_env(**env),
    )
    notifications: list[str] = []

    async def on_message(message: Any) -> None:
        if getattr(message, "method", None):
            notifications.append(message.method)

    with log.open("a") as errlog:
        async with Client(
            stdio_client(params, errlog=errlog),
            mode="legacy",
            message_handler=on_message,
            read_timeout_seconds=60,
        ) as client:
            yield Served(client, log, notifications)


async def advertised(client: Client, name: str = "record") -> Any:
    return {tool.name: tool for tool in (await client.list_tools()).tools}[name]


def is_real(tool: Any) -> bool:
    """Advertised with what the upstream declared: its description and its own parameter."""
    own = tool.input_schema.get("properties", {})
    return (tool.description or "").startswith(DESCRIPTION) and "note" in own


async def kept(url: str) -> dict[str, Any]:
    """What the ledger at `url` keeps of the stub upstream's tools."""
    ledger = await open_ledger(url)
    try:
        return (await ledger.tool_definitions(["stub"])).get("stub", {})
    finally:
        await ledger.close()


async def recorded(url: str) -> dict[str, Any]:
    """Once the ledger keeps the stub's own definition of `record` (written after each listing)."""

    async def real() -> dict[str, Any] | None:
        try:
            definition = (await kept(url)).get("record")
        except LedgerUnavailable:  # the server is writing it this moment (SQLite): ask again
            return None
        return definition if definition and definition.get("description") == DESCRIPTION else None

    found: dict[str, Any] = await eventually(real, within=30)
    return found


def effects(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def init(config: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`commitgate policy init --from-config CONFIG -o OUT`, a process of its own."""
    argv = [sys.executable, "-m", "commitgate.server.cli", "policy", "init", "--from-config", str(config)]
    argv += ["-o", str(out), "--connect-timeout", "30s"]
    return subprocess.run(argv, capture_output=True, text=True, env=base_env(**env), timeout=120)


async def test_an_upstream_that_starts_late_is_advertised_from_the_first_listing(tmp_path: Path) -> None:
    # The policy's ledger is the default one, in the user's state directory: here, under tmp_path.
    state = {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path)}
    port, log, gate = free_port(), tmp_path / "effects.jsonl", tmp_path / "up"
    config = tmp_path / "claude_desktop_config.json"
    # A secret header: init writes it as a ${STUB_AUTHORIZATION} reference, unset where init runs.
    entry = {
        "type": "http",
        "url": f"http://127.0.0.1:{port}/mcp",
        "headers": {"Authorization": "Bearer t0k"},
    }
    config.write_text(json.dumps({"mcpServers": {"stub": entry}}))
    policy = tmp_path / "commitgate.toml"
    with upstream(port, log):
        done = init(config, policy, state)
        assert done.returncode == 0, done.stderr

    with upstream(port, log, gate):  # started ahead, it listens LATE seconds after serve starts
        started = time.monotonic()
        async with serving(
            policy, tmp_path / "serve.log", {**state, "STUB_AUTHORIZATION": "Bearer t0k"}
        ) as served:
            first = await advertised(served.client)
            listed_at = time.monotonic() - started
            placeholder = 0.0 if is_real(first) else None
            print(f"\nfirst tools/list {listed_at:.1f}s after start; placeholder time: {placeholder}")
            assert is_real(first), first
            assert not gate.exists(), "the upstream was up before the first listing"

            await anyio.sleep(max(0.0, started + LATE - time.monotonic()))
            gate.touch()
            await listening(port)  # the call is about the first listing, not about waiting for a start
            called = await served.client.call_tool("record", {"note": "late", "idempotency_key": "late-1"})
            assert not called.is_error, text(called)
            assert "upstream stub: connected" in served.logged()
            # It connected with the definitions it was advertised with: nothing to announce. The
            # refresh that would announce runs at connect; give it a moment to have run.
            await anyio.sleep(1.0)
            assert await advertised(served.client) == first
            assert CHANGED not in served.notifications
    assert [e["note"] for e in effects(log)] == ["late"]


async def test_a_changed_definition_is_announced_and_kept(tmp_path: Path) -> None:
    port, log, ledger_path = free_port(), tmp_path / "effects.jsonl", tmp_path / "ledger.db"
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[ledger]\nurl = "sqlite:///{ledger_path}"\n\n[upstreams.stub]\nurl = "http://127.0.0.1:{port}/mcp"\n'
        '\n[tools.record]\nupstream = "stub"\nclass = "key-required"\n'
    )
    older = {"name": "record", "description": "An older description.", "inputSchema": {"type": "object"}}
    ledger = await open_ledger(f"sqlite:///{ledger_path}")
    await ledger.record_tool_definitions("stub", {"record": older}, time.time())
    await ledger.close()

    with upstream(port, log):
        async with serving(policy, tmp_path / "serve.log", {}) as served:
            first = await advertised(served.client)
            if not is_real(first):  # listed before the upstream connected: as the ledger kept it
                assert (first.description or "").startswith("An older description."), first
                await eventually(lambda: CHANGED in served.notifications, within=30)
            assert is_real(await advertised(served.client))
            definition = await recorded(f"sqlite:///{ledger_path}")  # what the next start advertises
    assert "note" in definition["inputSchema"]["properties"]


@pytest.mark.postgres
async def test_replicas_on_one_postgres_ledger_share_what_an_upstream_listed(tmp_path: Path) -> None:
    url = await fresh_url()
    port, log = free_port(), tmp_path / "effects.jsonl"
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[ledger]\nurl = "{url}"\n\n[upstreams.stub]\nurl = "http://127.0.0.1:{port}/mcp"\n'
        '\n[tools.record]\nupstream = "stub"\nclass = "key-required"\n'
    )
    with upstream(port, log):
        async with serving(policy, tmp_path / "first.log", {}) as first:

            async def connected() -> bool:
                return is_real(await advertised(first.client))

            await eventually(connected, within=30)
            await recorded(url)
    # The upstream is gone now: the second replica has only the ledger to go by.
    async with serving(policy, tmp_path / "second.log", {}) as second:
        assert is_real(await advertised(second.client))
        assert "upstream stub: connected" not in second.logged()
    assert effects(log) == []


async def test_an_upstream_added_while_serving_is_advertised_as_kept(tmp_path: Path) -> None:
    """An upstream the policy gains by an edit, not reachable yet: its tool is advertised from the
    definitions the ledger keeps, as at a start."""
    port, ledger_path = free_port(), tmp_path / "ledger.db"
    ledger = await open_ledger(f"sqlite:///{ledger_path}")
    record = {"name": "record", "description": DESCRIPTION, "inputSchema": NOTE_SCHEMA}
    await ledger.record_tool_definitions("stub", {"record": record}, time.time())
    await ledger.close()
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[ledger]\nurl = "sqlite:///{ledger_path}"\n')
    async with serving(policy, tmp_path / "serve.log", {}) as served:
        policy.write_text(  # nothing listens on `port`: the upstream cannot list its tools
            policy.read_text() + f'\n[upstreams.stub]\nurl = "http://127.0.0.1:{port}/mcp"\n'
            '\n[tools.record]\nupstream = "stub"\nclass = "key-required"\n'
        )

        async def added() -> Any:
            return {t.name: t for t in (await served.client.list_tools()).tools}.get("record")

        tool = await eventually(added, within=30)
        assert is_real(tool), tool
