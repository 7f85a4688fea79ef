"""Hot reload of the policy file: in-process through the reloader, and through real server processes.

A valid edit is applied for new calls and announced (handshake era:
`notifications/tools/list_changed`; 2026-07-28: `subscriptions/listen`); an
invalid edit is rejected with the messages `policy check` prints, and the old
tools keep serving; a call in flight finishes with the tool it started with.
Waiting is polling against a deadline, never a fixed sleep.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.subscriptions import ToolsListChanged

from commitgate.server.demo import tools as demo
from commitgate.server.policy.loading import load_policy
from commitgate.server.serve.checking import check_policy_file, format_report
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.meta_tools import META_TOOLS
from commitgate.server.serve.reload import PolicyReloader, ReloadStatus

pytestmark = pytest.mark.anyio

DEADLINE = 30.0

EMAIL = """
[tools.send_email]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
timeout = "10s"
"""
BALANCE = """
[tools.get_balance]
class = "safe-retry"
python = "commitgate.server.demo.tools:get_balance"
"""
TICKET = """
[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"
"""
HOLD = """
[tools.hold]
class = "key-required"
python = "cg_gate:hold"
timeout = "60s"
"""
BROKEN = """
[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"
retry = { attempts = 0 }

[tools.send_email]
class = "key-requird"
python = "commitgate.server.demo.tools:send_email"
"""

GATE_MODULE = '''
"""A side effect whose moment the test decides: it waits for a gate file, then records itself."""
from pathlib import Path

import anyio
from commitgate.server.model.context import OperationContext

BASE = Path({base!r})


async def hold(label: str, ctx: OperationContext | None = None) -> dict:
    """Wait until the test opens the gate, then record one effect."""
    (BASE / f"started-{{label}}").touch()
    while not (BASE / f"open-{{label}}").exists():
        await anyio.sleep(0.02)
    with (BASE / "effects.log").open("a") as log:
        log.write(label + "\\n")
    return {{"label": label, "done": True}}
'''


def write_policy(path: Path, *tables: str) -> None:
    """Replace the file atomically, as editors that save through a temporary file do."""
    text = '[server]\nname = "reload-test"\n' + "".join(textwrap.dedent(t) for t in tables)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    with anyio.fail_after(DEADLINE):
        while not await check():
            await anyio.sleep(0.05)


# --- in-process: the reloader --------------------------------------------------------------------------


@pytest.fixture
def policy_path(tmp_path: Path, sandbox: Path) -> Path:
    path = tmp_path / "policy.toml"
    write_policy(path, f'\n[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n', EMAIL, BALANCE)
    return path


@asynccontextmanager
async def reloader_for(path: Path) -> AsyncIterator[tuple[Gateway, PolicyReloader, list[int]]]:
    gateway = await Gateway.open(load_policy(path), path)
    announced: list[int] = []

    async def on_applied() -> None:
        announced.append(len(names(gateway)))

    reloader = PolicyReloader(gateway, path, on_applied, quiet=0.0)
    await reloader.prime()
    try:
        yield gateway, reloader, announced
    finally:
        await gateway.close()


async def settled(reloader: PolicyReloader) -> Any:
    """A reload, read twice when the edit weakens a guard (it applies on the second read)."""
    result = await reloader.reload()
    if result.status is ReloadStatus.WAITING:
        result = await reloader.reload()
    return result


def ledger_table(path: Path) -> str:
    return f'\n[ledger]\nurl = "sqlite:///{path.parent / "ledger.db"}"\n'


def names(gateway: Gateway) -> set[str]:
    return {t.name for t in gateway.list_tools()} - set(META_TOOLS)


async def test_valid_edits_apply_for_new_calls_and_announce_only_real_changes(policy_path: Path) -> None:
    async with reloader_for(policy_path) as (gateway, reloader, announced):
        assert (await reloader.reload()).status is ReloadStatus.UNCHANGED
        email_source = gateway.served["send_email"].guard.source

        write_policy(policy_path, ledger_table(policy_path), EMAIL, BALANCE, TICKET)
        result = await settled(reloader)
        assert (result.status, result.announced) == (ReloadStatus.APPLIED, True)
        assert names(gateway) == {"send_email", "get_balance", "create_ticket"}
        assert gateway.served["send_email"].guard.source is email_source  # unchanged tools are kept
        ticket = await gateway.call_tool("create_ticket", {"title": "t", "idempotency_key": "k1"}, None, None)
        assert not ticket.is_error and demo.count("tickets") == 1

        write_policy(policy_path, ledger_table(policy_path), EMAIL.replace('"10s"', '"20s"'), BALANCE, TICKET)
        result = await reloader.reload()
        assert (result.status, result.announced) == (ReloadStatus.APPLIED, False)  # same tool list
        assert gateway.served["send_email"].guard.policy.timeout == 20.0

        write_policy(policy_path, ledger_table(policy_path), EMAIL, BALANCE)
        assert (await reloader.reload()).announced is True
        assert not gateway.has_tool("create_ticket")
        status = await gateway.call_tool("get_operation_status", {"idempotency_key": "k1"}, None, None)
        assert status.structured_content["found"] is True  # a removed tool's records stay answerable
        assert status.structured_content["operation"]["tool"] == "create_ticket"
        assert announced == [3, 2]


async def test_an_invalid_edit_is_rejected_with_the_messages_of_check(
    policy_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with reloader_for(policy_path) as (gateway, reloader, announced):
        before = gateway.policy
        write_policy(policy_path, ledger_table(policy_path), BROKEN)
        with caplog.at_level(logging.ERROR, logger="commitgate.reload"):
            result = await reloader.reload()
        assert result.status is ReloadStatus.REJECTED
        expected = check_policy_file(policy_path)
        assert result.problems == expected and len(expected) == 2
        assert format_report(str(policy_path), expected) in caplog.text
        assert "the previous policy keeps serving" in caplog.text
        assert gateway.policy is before and names(gateway) == {"send_email", "get_balance"}
        sent = await gateway.call_tool(
            "send_email", {"to": "a@b.c", "subject": "s", "body": "b", "idempotency_key": "e1"}, None, None
        )
        assert not sent.is_error and demo.count("emails") == 1

        caplog.clear()
        assert (
            await reloader.reload()
        ).status is ReloadStatus.UNCHANGED  # the same bad text is not re-logged
        assert caplog.text == ""
        write_policy(policy_path, ledger_table(policy_path), EMAIL, TICKET)
        assert (await settled(reloader)).status is ReloadStatus.APPLIED
        assert names(gateway) == {"send_email", "create_ticket"}
        assert announced == [2]


async def test_code_problems_reject_an_edit_too(policy_path: Path) -> None:
    booking = """
    [tools.reserve]
    class = "compensable"
    python = "commitgate.server.demo.tools:reserve"
    compensate = { tool = "release", arguments = { booking = "{result.booking_id}" } }

    [tools.release]
    class = "key-required"
    python = "commitgate.server.demo.tools:release"
    """
    async with reloader_for(policy_path) as (gateway, reloader, _):
        missing = TICKET.replace('create_ticket"', 'nope"')
        write_policy(policy_path, ledger_table(policy_path), EMAIL, missing, booking)
        result = await reloader.reload()
        assert result.status is ReloadStatus.REJECTED
        assert [str(p) for p in result.problems] == [
            "tools.create_ticket.python: module 'commitgate.server.demo.tools' has no attribute 'nope' (line 14)",
            "tools.reserve.compensate.arguments.booking: the compensating tool has no such argument (line 19)",
            "tools.reserve.compensate.arguments: the compensating tool also needs: 'booking_id' (line 19)",
        ]
        assert result.problems == check_policy_file(policy_path)  # the same messages as `check`
        assert names(gateway) == {"send_email", "get_balance"}


async def test_restart_only_settings_are_kept_and_said(
    policy_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with reloader_for(policy_path) as (gateway, reloader, _):
        ledger = gateway.policy.ledger
        moved = f'\n[ledger]\nurl = "sqlite:///{tmp_path / "other.db"}"\n'
        write_policy(policy_path, moved, EMAIL)
        with caplog.at_level(logging.WARNING, logger="commitgate.reload"):
            assert (await reloader.reload()).status is ReloadStatus.APPLIED
        assert "[ledger] changed" in caplog.text and "next restart" in caplog.text
        assert gateway.policy.ledger == ledger
        assert names(gateway) == {"send_email"}


async def test_an_emptied_file_and_an_edit_before_watching(policy_path: Path) -> None:
    async with reloader_for(policy_path) as (gateway, reloader, _):
        policy_path.write_text("")  # an editor truncating before it writes
        assert (await reloader.reload()).status is ReloadStatus.UNREADABLE
        assert names(gateway) == {"send_email", "get_balance"}
    write_policy(policy_path, ledger_table(policy_path), EMAIL)
    gateway = await Gateway.open(load_policy(policy_path), policy_path)
    try:
        write_policy(policy_path, ledger_table(policy_path), TICKET)  # edited after loading, before watching

        async def nothing() -> None:
            return None

        reloader = PolicyReloader(gateway, policy_path, nothing, quiet=0.0)
        await reloader.prime()
        assert reloader.changed_on_disk()
        assert (await settled(reloader)).status is ReloadStatus.APPLIED
        assert names(gateway) == {"create_ticket"}
    finally:
        await gateway.close()


# --- through real server processes -----------------------------------------------------------------------


class Server:
    """A `commitgate serve` process over stdio, its stderr in a file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.policy = tmp / "policy.toml"
        self.log = tmp / "server.log"
        self.notifications: list[str] = []

    def params(self) -> StdioServerParameters:
        env = {
            "COMMITGATE_SANDBOX": str(self.tmp / "sandbox.db"),
            "PYTHONUNBUFFERED": "1",
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(self.tmp),
        }
        args = ["-m", "commitgate.server.cli", "serve", "--policy", str(self.policy)]
        args += ["--ledger", f"sqlite:///{self.tmp / 'ledger.db'}", "--log-level", "info"]
        return StdioServerParameters(command=sys.executable, args=args, env=env, cwd=str(self.tmp))

    async def on_message(self, message: Any) -> None:
        method = getattr(message, "method", None)
        if method:
            self.notifications.append(method)

    @asynccontextmanager
    async def client(self, mode: str) -> AsyncIterator[Client]:
        with self.log.open("a") as errlog:
            transport = stdio_client(self.params(), errlog=errlog)
            async with Client(
                transport, mode=mode, message_handler=self.on_message, read_timeout_seconds=60
            ) as c:
                yield c

    def logged(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


async def tool_names(client: Client) -> set[str]:
    return {t.name for t in (await client.list_tools()).tools} - set(META_TOOLS)


@pytest.fixture
def server(tmp_path: Path) -> Server:
    return Server(tmp_path)


async def test_a_served_policy_follows_valid_edits_and_survives_invalid_ones(server: Server) -> None:
    write_policy(server.policy, EMAIL, BALANCE)
    async with server.client("legacy") as client:
        assert await tool_names(client) == {"send_email", "get_balance"}

        write_policy(server.policy, EMAIL, BALANCE, TICKET)

        async def ticket_served() -> bool:
            return "create_ticket" in await tool_names(client)

        await eventually(ticket_served, "the new tool")

        async def announced() -> bool:
            return server.notifications.count("notifications/tools/list_changed") >= 1

        await eventually(announced, "tools/list_changed")

        write_policy(server.policy, BROKEN)

        async def rejected() -> bool:
            return "policy edit rejected" in server.logged()

        await eventually(rejected, "the rejection in the log")
        for problem in check_policy_file(server.policy):
            assert str(problem) in server.logged()
        assert await tool_names(client) == {"send_email", "get_balance", "create_ticket"}
        made = await client.call_tool("create_ticket", {"title": "still served", "idempotency_key": "t-1"})
        assert not made.is_error
        demo_store = server.tmp / "sandbox.db"
        assert _count(demo_store, "tickets") == 1

        write_policy(server.policy, EMAIL, TICKET)

        async def balance_gone() -> bool:
            return "get_balance" not in await tool_names(client)

        await eventually(balance_gone, "the removal")
        await eventually(_at_least(server, 2), "a second tools/list_changed")
        # One announcement per applied change, none for the rejected edit.
        assert server.notifications.count("notifications/tools/list_changed") == 2


def _at_least(server: Server, n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return server.notifications.count("notifications/tools/list_changed") >= n

    return check


def _count(store: Path, table: str) -> int:
    import sqlite3

    with sqlite3.connect(store) as conn:
        return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


async def test_modern_clients_hear_of_the_change_on_their_listen_stream(server: Server) -> None:
    write_policy(server.policy, EMAIL, TICKET)
    async with server.client("auto") as client:
        assert client.protocol_version == "2026-07-28"
        assert await tool_names(client) == {"send_email", "create_ticket"}
        async with client.listen(tools_list_changed=True) as subscription:
            write_policy(server.policy, EMAIL)  # a removal applies at once; an addition waits for quiet
            with anyio.fail_after(DEADLINE):
                event = await subscription.__anext__()
            assert isinstance(event, ToolsListChanged)
        assert await tool_names(client) == {"send_email"}


async def test_a_call_in_flight_keeps_the_tool_it_started_with(server: Server) -> None:
    (server.tmp / "cg_gate.py").write_text(GATE_MODULE.format(base=str(server.tmp)))
    write_policy(server.policy, EMAIL, HOLD)
    async with server.client("legacy") as client, anyio.create_task_group() as tasks:
        results: list[Any] = []

        async def hold() -> None:
            results.append(await client.call_tool("hold", {"label": "a", "idempotency_key": "h-1"}))

        tasks.start_soon(hold)

        async def started() -> bool:
            return (server.tmp / "started-a").exists()

        await eventually(started, "the call to start")

        write_policy(server.policy, EMAIL)  # `hold` removed while it runs (a removal applies at once)

        async def replaced() -> bool:
            return await tool_names(client) == {"send_email"}

        await eventually(replaced, "the edit to apply")
        assert results == []  # still in flight
        (server.tmp / "open-a").touch()

        async def finished() -> bool:
            return bool(results)

        await eventually(finished, "the call to finish")
        [result] = results
        assert not result.is_error
        assert result.structured_content == {"label": "a", "done": True}
        assert result.meta["commitgate/operation"]["state"] == "SUCCEEDED"
        assert (server.tmp / "effects.log").read_text() == "a\n"

        status = await client.call_tool("get_operation_status", {"idempotency_key": "h-1"})
        operation = status.structured_content["operation"]
        assert (operation["tool"], operation["state"]) == ("hold", "SUCCEEDED")
        with pytest.raises(MCPError, match="Unknown tool"):
            await client.call_tool("hold", {"label": "b", "idempotency_key": "h-2"})
        assert (server.tmp / "effects.log").read_text() == "a\n"


# The settings a call is claimed under, and the edit made while it runs: a longer lease, a shorter
# respond_within, and a result limit below what `hold` returns.
CLAIMED_UNDER = """
lease = "9s"
respond_within = "30s"
limits = { max_result_bytes = 65536 }
"""
EDITED_TO = """
lease = "60s"
respond_within = "1s"
limits = { max_result_bytes = 16 }
"""


def _lease_left(operation: dict[str, Any]) -> float:
    return datetime.fromisoformat(operation["lease_expires_at"]).timestamp() - time.time()


async def test_a_call_in_flight_keeps_the_settings_it_was_claimed_under(server: Server) -> None:
    (server.tmp / "cg_gate.py").write_text(GATE_MODULE.format(base=str(server.tmp)))
    write_policy(server.policy, CLAIMED_UNDER, HOLD)
    async with server.client("legacy") as client, anyio.create_task_group() as tasks:
        results: list[Any] = []

        async def hold() -> None:
            results.append(await client.call_tool("hold", {"label": "a", "idempotency_key": "h-1"}))

        tasks.start_soon(hold)
        await eventually(_exists(server.tmp / "started-a"), "the call to start")

        write_policy(server.policy, EDITED_TO, HOLD)

        async def applied() -> bool:
            return "applied: 1 tool(s)" in server.logged()

        await eventually(applied, "the edit to apply")
        # Past the new respond_within, and past a lease renewal (every 3 s, a third of the lease the
        # server started with): the lease renewed is still the 9 s one the call was claimed under.
        with anyio.fail_after(DEADLINE):
            renewed_after = time.time() + 4.0
            while time.time() < renewed_after:
                status = await client.call_tool("get_operation_status", {"idempotency_key": "h-1"})
                operation = status.structured_content["operation"]
                assert operation["state"] == "RUNNING"
                assert _lease_left(operation) <= 9.5
                await anyio.sleep(0.25)
        assert results == []  # the old respond_within: no operation_in_progress answer yet
        (server.tmp / "open-a").touch()

        async def finished() -> bool:
            return bool(results)

        await eventually(finished, "the call to finish")
        [result] = results
        assert not result.is_error
        assert result.structured_content == {"label": "a", "done": True}  # the old result limit
        assert result.meta["commitgate/operation"]["state"] == "SUCCEEDED"
        status = await client.call_tool("get_operation_status", {"idempotency_key": "h-1"})
        assert (
            status.structured_content["operation"]["result"]["structuredContent"] == result.structured_content
        )

        (server.tmp / "open-b").touch()  # a new call follows the new settings
        later = await client.call_tool("hold", {"label": "b", "idempotency_key": "h-2"})
        assert later.structured_content["result_too_large"]["limit"] == 16
        assert (server.tmp / "effects.log").read_text() == "a\nb\n"  # one effect per call


def _exists(path: Path) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return path.exists()

    return check


STUB_UPSTREAM = '''
from mcp.server.mcpserver import MCPServer

mcp = MCPServer("stub")


@mcp.tool()
def add_note(text: str) -> str:
    """Add a note."""
    return text.upper()


if __name__ == "__main__":
    mcp.run()
'''


async def test_an_edit_can_add_and_remove_an_upstream_server(policy_path: Path, tmp_path: Path) -> None:
    (tmp_path / "stub_upstream.py").write_text(STUB_UPSTREAM)
    upstream = f"""
    [upstreams.notes]
    command = "{sys.executable}"
    args = ["{tmp_path / "stub_upstream.py"}"]

    [tools.add_note]
    class = "key-required"
    upstream = "notes"
    """
    async with reloader_for(policy_path) as (gateway, reloader, _):
        write_policy(policy_path, ledger_table(policy_path), EMAIL, upstream)
        assert (await settled(reloader)).status is ReloadStatus.APPLIED
        assert names(gateway) == {"send_email", "add_note"}
        noted = await gateway.call_tool("add_note", {"text": "hi", "idempotency_key": "n1"}, None, None)
        assert not noted.is_error and "HI" in noted.content[0].text  # type: ignore[union-attr]
        assert gateway.upstreams is not None
        spec = gateway.policy.upstreams["notes"]
        assert gateway.upstreams.connection("notes", spec) is not None

        write_policy(policy_path, ledger_table(policy_path), EMAIL)
        assert (await reloader.reload()).status is ReloadStatus.APPLIED
        assert names(gateway) == {"send_email"}
        assert gateway.upstreams.connection("notes", spec) is None  # closed with the edit that removed it
