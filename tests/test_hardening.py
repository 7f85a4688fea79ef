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

from commitgate.server.demo import tools as demo
from commitgate.server.ledger import LedgerUnavailable, OperationFilter
from commitgate.server.policy.loading import load_policy
from commitgate.server.serve.gateway import Gateway

pytestmark = pytest.mark.anyio

POLICY = """
[server]
principal = "agent"

[ledger]
url = "{url}"

[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"
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
    return await gw.call_tool(
        "create_ticket", {"title": f"printer {key}", "idempotency_key": key}, meta, None
    )


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
    from support.postgres import fresh_url

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

    from commitgate.server.policy.loading import analyse_file

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
args = ["--api-key", "ak-args-111", "--token=tk-args-222", "--verbose", "serve"]
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
    from support.policy import run

    path = tmp_path / "policy.toml"
    path.write_text(SECRETS_POLICY, encoding="utf-8")
    shown = run(capsys, ["policy", "show", *(["--json"] if as_json else []), str(path)])
    assert shown.code == 0, shown.text
    for secret in ("hunter2", "tok-upstream-777", "sk-live-upstream-555", "tok-env-999", "abc123secret"):
        assert secret not in shown.text
    for secret in ("sk-live-123", "k-456", "ak-args-111", "tk-args-222"):
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
        assert doc["upstreams"]["local"]["args"] == ["--api-key", "***", "--token=***", "--verbose", "serve"]


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
    from support.policy import run

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


# --- reading commands never create or migrate ---------------------------------------------------------


def _foreign_db(path: Path, tables: str) -> None:
    import sqlite3

    with sqlite3.connect(path) as conn:
        conn.executescript(tables)
    conn.close()


FOREIGN = {
    "unrelated-operations": "CREATE TABLE operations (id INTEGER PRIMARY KEY, amount REAL); INSERT INTO operations VALUES (1, 2.5);",
    "other-app": "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO customers VALUES (1, 'ann');",
    "not-sqlite": None,
}


@pytest.mark.parametrize("kind", list(FOREIGN))
@pytest.mark.parametrize(
    "command",
    [
        ["ops", "list"],
        ["ops", "show", "op_x"],
        ["stats"],
        ["ops", "purge"],
        ["ops", "resolve", "op_x", "--failed", "--reason", "r"],
    ],
)
async def test_ledger_commands_leave_a_foreign_database_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, command: list[str]
) -> None:
    import anyio.to_thread
    from support.policy import run

    path = tmp_path / "other-app.db"
    tables = FOREIGN[kind]
    if tables is None:
        path.write_text("name,amount\nann,2.5\n", encoding="utf-8")
    else:
        _foreign_db(path, tables)
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    done = await anyio.to_thread.run_sync(run, capsys, [*command, "--ledger", f"sqlite:///{path}"])
    assert done.code != 0
    assert "Traceback" not in done.text
    reason = [line for line in done.err.splitlines() if not line.startswith("commitgate: ledger ")]
    assert len(reason) == 1 and "not a commitgate ledger" in reason[0], done.err
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-app.db"]


@pytest.mark.parametrize("command", [["ops", "list"], ["ops", "show", "op_x"], ["stats"]])
async def test_reading_commands_on_a_missing_ledger_say_so_and_create_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    import anyio.to_thread
    from support.policy import run

    path = tmp_path / "nothing-here.db"
    done = await anyio.to_thread.run_sync(run, capsys, [*command, "--ledger", f"sqlite:///{path}"])
    assert done.code != 0
    assert "no ledger at" in done.err and "Traceback" not in done.text
    assert not path.exists() and list(tmp_path.iterdir()) == []


async def test_a_server_refuses_another_applications_database(tmp_path: Path) -> None:
    from commitgate.server.ledger.sqlite import SQLiteLedger

    path = tmp_path / "other-app.db"
    _foreign_db(path, FOREIGN["unrelated-operations"] or "")
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    with pytest.raises(LedgerUnavailable, match="not a commitgate ledger"):
        await SQLiteLedger.open(path)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


async def test_reading_commands_leave_a_ledger_file_unchanged(
    tmp_path: Path, sandbox: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import anyio.to_thread
    from support.policy import run

    async with gateway(write_policy(tmp_path)) as gw:
        assert not (await ticket(gw, "one")).is_error
    path = tmp_path / "ledger.db"
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    for command in (["ops", "list"], ["stats"]):
        done = await anyio.to_thread.run_sync(run, capsys, [*command, "--ledger", f"sqlite:///{path}"])
        assert done.code == 0, done.text
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


# --- one default ledger per policy file -----------------------------------------------------------------

BARE = """
[server]
principal = "agent"

[tools.{tool}]
class = "key-required"
python = "commitgate.server.demo.tools:{tool}"
"""


async def test_each_policy_file_has_its_own_default_ledger(
    tmp_path: Path, sandbox: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import anyio.to_thread
    from support.policy import run

    from commitgate.server.ledger import default_ledger_url

    state = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.delenv("COMMITGATE_POLICY", raising=False)
    tickets, emails = tmp_path / "tickets" / "policy.toml", tmp_path / "emails" / "policy.toml"
    for path, tool in ((tickets, "create_ticket"), (emails, "send_email")):
        path.parent.mkdir()
        path.write_text(BARE.format(tool=tool), encoding="utf-8")
    meta = {"commitgate/session": "s1"}
    async with gateway(tickets) as gw:
        one = await gw.call_tool("create_ticket", {"title": "t", "idempotency_key": "step-1"}, meta, None)
        assert not one.is_error
    async with gateway(emails) as gw:
        arguments = {"to": "a@example.com", "subject": "s", "body": "b", "idempotency_key": "step-1"}
        two = await gw.call_tool("send_email", arguments, meta, None)
        assert not two.is_error, two.structured_content  # not idempotency_key_reused: another ledger
    assert demo.count("tickets") == 1 and demo.count("emails") == 1

    urls = {default_ledger_url(tickets), default_ledger_url(emails), default_ledger_url(None)}
    assert len(urls) == 3 and default_ledger_url(None).endswith("/commitgate/ledger.db")
    assert all(url.startswith(f"sqlite:///{state}/commitgate/") for url in urls)

    listed = await anyio.to_thread.run_sync(run, capsys, ["ops", "list", "--json", "--policy", str(tickets)])
    assert listed.code == 0, listed.text
    assert [op["tool"] for op in json.loads(listed.out)["operations"]] == ["create_ticket"]
    assert listed.err.strip() == (
        f"commitgate: ledger {default_ledger_url(tickets)} (the default ledger of {tickets.resolve()})"
    )


@pytest.mark.parametrize("command", [["ops", "list"], ["stats"], ["ops", "purge"]])
async def test_every_ledger_command_names_the_ledger_it_opened(
    tmp_path: Path, sandbox: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    import anyio.to_thread
    from support.policy import run

    policy = write_policy(tmp_path)
    async with gateway(policy) as gw:
        assert not (await ticket(gw, "one")).is_error
    done = await anyio.to_thread.run_sync(run, capsys, [*command, "--policy", str(policy)])
    assert done.code == 0, done.text
    said = [line for line in done.err.splitlines() if line.startswith("commitgate: ledger ")]
    assert said == [
        f"commitgate: ledger sqlite:///{tmp_path / 'ledger.db'} ([ledger] url of {policy.resolve()})"
    ]


@pytest.mark.parametrize("command", [["ops", "list"], ["stats"]])
async def test_postgres_reading_commands_never_create_tables(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    import anyio.to_thread
    import asyncpg
    from support.policy import run
    from support.postgres import fresh_url

    url = await fresh_url()
    done = await anyio.to_thread.run_sync(run, capsys, [*command, "--ledger", url])
    assert done.code == 1 and "no commitgate ledger in this database" in done.err, done.text
    conn = await asyncpg.connect(url)
    try:
        tables = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
    finally:
        await conn.close()
    assert tables == []


def test_a_status_check_that_cannot_be_imported_is_reported_on_its_own_line(tmp_path: Path) -> None:
    from commitgate.server.serve.checking import check_policy_file

    path = tmp_path / "policy.toml"
    path.write_text(
        '[tools.charge]\nclass = "key-and-status-check"\npython = "commitgate.server.demo.tools:charge_card"\n'
        'status_check = "no_such_module_here:find"\n',
        encoding="utf-8",
    )
    problems = check_policy_file(path)
    assert [(p.location, p.line) for p in problems] == [("tools.charge.status_check", 4)], problems
    assert "no_such_module_here" in problems[0].message
