"""What an attacker or a hostile environment tried, in-process: each fails closed, clearly.

A real gateway on a real SQLite ledger file (PostgreSQL where the point is about it); effects are
counted in the demo sandbox (the system of record).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp.types import CallToolResult

from commitgate.server.ledger import LedgerUnavailable, OperationFilter
from commitgate.server.policy.models import load_policy
from commitgate.server.serve.gateway import Gateway
from commitgate.tools import demo

pytestmark = pytest.mark.anyio

POLICY = """
[server]
principal = "agent"

[ledger]
url = "{url}"

[tools.create_ticket]
class = "key-required"
python = "commitgate.tools.demo:create_ticket"
"""


def write_policy(tmp_path: Path, url: str | None = None) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY.format(url=url or f"sqlite:///{tmp_path / 'ledger.db'}"), encoding="utf-8")
    return path


@asynccontextmanager
async def gateway(policy_file: Path) -> AsyncIterator[Gateway]:
    gw = await Gateway.open(load_policy(policy_file), policy_file)
    try:
        yield gw
    finally:
        await gw.close()


async def ticket(gw: Gateway, key: Any, session: Any = "s1") -> CallToolResult:
    meta = {"commitgate/session": session}
    return await gw.call_tool("create_ticket", {"title": "printer", "idempotency_key": key}, meta, None)


def code_of(result: CallToolResult) -> str | None:
    return (result.structured_content or {}).get("error", {}).get("code") if result.is_error else None


def message_of(result: CallToolResult) -> str:
    return str((result.structured_content or {}).get("error", {}).get("message", ""))


# --- keys and sessions ------------------------------------------------------------------------


async def test_a_key_with_a_trailing_newline_is_invalid_and_nothing_runs(
    tmp_path: Path, sandbox: Path
) -> None:
    async with gateway(write_policy(tmp_path)) as gw:
        result = await ticket(gw, "ticket-1\n")
        assert code_of(result) == "invalid_idempotency_key"
        assert demo.count("tickets") == 0
        assert not (await ticket(gw, "ticket-1")).is_error
        assert demo.count("tickets") == 1


@pytest.mark.parametrize(
    "session",
    ["\x1b[31mRED\x1b[0m\x1b]0;pwned\x07", "nul\x00byte", "line\nbreak", "c1\x9bcontrol", "del\x7f"],
    ids=["escapes", "nul", "newline", "c1", "del"],
)
async def test_a_session_with_control_characters_is_refused_before_the_ledger(
    tmp_path: Path, sandbox: Path, session: str
) -> None:
    async with gateway(write_policy(tmp_path)) as gw:
        result = await ticket(gw, "ticket-1", session=session)
        assert code_of(result) == "invalid_arguments"
        assert "printable" in message_of(result)
        assert demo.count("tickets") == 0
        assert await gw.ledger.find(OperationFilter(None)) == []  # nothing recorded


async def test_a_printable_unicode_session_is_accepted(tmp_path: Path, sandbox: Path) -> None:
    async with gateway(write_policy(tmp_path)) as gw:
        assert not (await ticket(gw, "ticket-1", session="Zürich – 東京")).is_error
        assert demo.count("tickets") == 1


async def test_postgres_a_nul_in_a_session_is_invalid_and_the_answer_names_no_database(
    tmp_path: Path, sandbox: Path
) -> None:
    from pg_support import fresh_url

    url = await fresh_url()
    async with gateway(write_policy(tmp_path, url)) as gw:
        result = await ticket(gw, "ticket-1", session="nul\x00byte")
        assert code_of(result) == "invalid_arguments"  # not ledger_unavailable: retrying cannot help
        text = str(result.structured_content) + str(result.content)
        for secret in ("postgres", "127.0.0.1", "commitgate_test_", "asyncpg", "Error"):
            assert secret not in text
        assert demo.count("tickets") == 0


# --- the ledger file disappears under a running server --------------------------------------------


def _remove_ledger(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _rename_ledger(path: Path) -> None:
    path.rename(path.with_name("moved.db"))


def _replace_ledger(path: Path) -> None:
    fresh = path.with_name("fresh.db")
    fresh.write_bytes(b"")
    fresh.replace(path)


@pytest.mark.parametrize(
    "remove", [_remove_ledger, _rename_ledger, _replace_ledger], ids=["unlinked", "renamed", "replaced"]
)
async def test_a_ledger_file_gone_from_its_path_fails_closed(
    tmp_path: Path, sandbox: Path, caplog: pytest.LogCaptureFixture, remove: Any
) -> None:
    ledger_path = tmp_path / "ledger.db"
    async with gateway(write_policy(tmp_path)) as gw:
        assert not (await ticket(gw, "before")).is_error
        remove(ledger_path)
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            first, second = await ticket(gw, "after-1"), await ticket(gw, "after-2")
        assert code_of(first) == code_of(second) == "ledger_unavailable"
        assert str(tmp_path) not in message_of(first)  # where the ledger lives is the operator's business
        assert demo.count("tickets") == 1  # nothing ran into a file nobody will read again
        with pytest.raises(LedgerUnavailable):
            await gw.ledger.check_writable()  # what /healthz asks
        said = [r for r in caplog.records if str(ledger_path) in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]  # logged once, not per call


async def test_a_ledger_moved_back_serves_again(tmp_path: Path, sandbox: Path) -> None:
    ledger_path = tmp_path / "ledger.db"
    async with gateway(write_policy(tmp_path)) as gw:
        assert not (await ticket(gw, "before")).is_error
        ledger_path.rename(tmp_path / "aside.db")
        assert code_of(await ticket(gw, "while-away")) == "ledger_unavailable"
        (tmp_path / "aside.db").rename(ledger_path)
        assert not (await ticket(gw, "after")).is_error
        assert demo.count("tickets") == 2


async def test_a_restart_after_the_ledger_vanished_never_runs_a_key_twice(
    tmp_path: Path, sandbox: Path
) -> None:
    policy = write_policy(tmp_path)
    async with gateway(policy) as gw:
        _remove_ledger(tmp_path / "ledger.db")
        assert code_of(await ticket(gw, "lost")) == "ledger_unavailable"
    async with gateway(policy) as gw:
        assert not (await ticket(gw, "lost")).is_error
    assert demo.count("tickets") == 1


# --- modules beside the policy ------------------------------------------------------------------------


def test_a_policy_directory_writable_by_others_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from commitgate.server.serve.registry import importable_beside_policy

    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    private.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING):
        importable_beside_policy(private)
        assert not caplog.records
        importable_beside_policy(shared)
    assert [
        str(shared) in r.getMessage() and "writable by other users" in r.getMessage() for r in caplog.records
    ] == [True]
    import sys

    assert sys.path[-2:] == [str(private), str(shared)]  # after the standard library, never before


def test_policy_check_refuses_a_fifo_without_waiting_for_a_writer(tmp_path: Path) -> None:
    import threading

    from commitgate.server.policy.models import analyse_file

    fifo = tmp_path / "policy.toml"
    os.mkfifo(fifo)
    reports: list[Any] = []
    reader = threading.Thread(target=lambda: reports.append(analyse_file(fifo)), daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # blocked in open(): let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY))
        reader.join(5)
        pytest.fail("reading a FIFO policy blocked until a writer came")
    (report,) = reports
    assert report.policy is None
    assert [p.message for p in report.problems] == [
        "not a regular file (a FIFO, socket or device?); refusing to read it"
    ]


# --- policy show ----------------------------------------------------------------------------------------

SECRETS_POLICY = """
[ledger]
url = "postgresql://app:hunter2@db.internal:5432/ledger"

[upstreams.files]
url = "https://mcp.example.com/mcp?access_token=tok-upstream-777&region=eu"
headers = { Authorization = "Bearer sk-live-upstream-555", X-Trace = "visible-trace" }

[upstreams.local]
command = "files-server"
env = { API_TOKEN = "tok-env-999", LOG_LEVEL = "debug", FROM_ENV_KEY = "${HOME}" }

[tools.notify]
class = "key-required"
http = { url = "https://api.example.com/v1/notify?api_key=abc123secret&channel=ops", headers = { Authorization = "Bearer sk-live-123", X-Api-Key = "k-456" } }
input_schema = { type = "object", properties = { text = { type = "string" } } }
"""


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_policy_show_masks_secrets_written_in_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    from support_policy import run

    path = tmp_path / "policy.toml"
    path.write_text(SECRETS_POLICY, encoding="utf-8")
    shown = run(capsys, ["policy", "show", *(["--json"] if as_json else []), str(path)])
    assert shown.code == 0, shown.text
    for secret in ("hunter2", "tok-upstream-777", "sk-live-upstream-555", "tok-env-999", "abc123secret"):
        assert secret not in shown.text
    for secret in ("sk-live-123", "k-456"):
        assert secret not in shown.text
    assert "***" in shown.text
    for kept in ("db.internal", "region=eu", "channel=ops"):
        assert kept in shown.text  # what is not a secret still shows
    if as_json:
        doc = __import__("json").loads(shown.out)
        assert doc["upstreams"]["local"]["env"] == {
            "API_TOKEN": "***",
            "LOG_LEVEL": "debug",
            "FROM_ENV_KEY": "${HOME}",  # a reference is not a secret: shown as written
        }
        assert doc["upstreams"]["files"]["headers"]["X-Trace"] == "visible-trace"


# --- what the CLI prints of what clients sent ------------------------------------------------------------

HOSTILE = "\x1b[31mRED\x1b[0m\x1b]0;pwned\x07[bold]markup[/bold]\x9b2J\x7f"


async def _hostile_record(path: Path) -> str:
    """A record whose client-chosen fields hold terminal escapes (written before sessions were checked)."""
    import time

    from commitgate.server.ledger.base import ClaimRequest, this_owner
    from commitgate.server.ledger.sqlite import SQLiteLedger
    from commitgate.server.model.facts import IdempotencyClass

    ledger = await SQLiteLedger.open(path)
    try:
        request = ClaimRequest(
            "agent",
            HOSTILE,
            "key-1",
            "send_email",
            IdempotencyClass.KEY_REQUIRED,
            "f" * 64,
            '{"subject": "' + HOSTILE.replace("\x1b", "\\u001b").replace("\x07", "\\u0007") + '"}',
            this_owner(),
            60.0,
            3600.0,
        )
        claim = await ledger.claim(request, time.time())
    finally:
        await ledger.close()
    return claim.operation.operation_id


@pytest.mark.parametrize(
    "command", [["ops", "list"], ["ops", "list", "--json"], ["ops", "show"], ["ops", "show", "--json"]]
)
async def test_the_cli_escapes_what_a_client_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    import anyio.to_thread
    from support_policy import run

    op_id = await _hostile_record(tmp_path / "ledger.db")
    argv = [
        *command,
        *([op_id] if command[1] == "show" else []),
        "--ledger",
        f"sqlite:///{tmp_path / 'ledger.db'}",
    ]
    shown = await anyio.to_thread.run_sync(run, capsys, argv)
    assert shown.code == 0, shown.text
    for raw in ("\x1b", "\x07", "\x9b", "\x7f"):
        assert raw not in shown.out
    assert "RED" in shown.out  # shown, escaped, not dropped
    if "--json" not in command:
        assert "[bold]" in shown.out  # rich markup from a client is shown, not applied
