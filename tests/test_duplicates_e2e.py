"""Duplicate detection end to end: real `commitgate serve` processes over stdio, charges counted in the sandbox.

A call with a key not seen before whose tool and arguments match a recent operation in scope
answers `possible_duplicate`, executes nothing and records nothing; `confirm_duplicate: true`
lets a deliberate second action through (recorded in the audit trail); `scope`, `action`,
`window` and `duplicates = false` change what counts. Of N identical calls with N fresh keys
arriving together exactly one charges, on SQLite and on PostgreSQL.

Most tests share one server (module scope), each in sessions of its own and counting only
its own charges; each option is a tool of its own in that server's policy. The concurrent
tests, which slow every charge down, have servers of their own.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import CallToolResult
from support.e2e import (
    CONSOLE_SCRIPT,
    TOOLS_TOML,
    Deployment,
    Server,
    error,
    error_code,
    new_id,
    operation,
    policy_toml,
    run_together,
    serve,
    together,
)

pytestmark = pytest.mark.slow

CHARGE = {"card": "4242", "amount_cents": 1299, "description": "order 42"}

TOOLS = """
[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
timeout = "10s"
{duplicates}

[tools.get_balance]
class = "safe-retry"
python = "commitgate.server.demo.tools:get_balance"
"""
# charge_card once more for each option, beside the default one (shared-server tests)
OPTIONS = {
    "charge_in_principal": 'duplicates = { scope = "principal" }',
    "charge_allowing": 'duplicates = { action = "allow" }',
    "charge_unchecked": "duplicates = false",
    "charge_briefly": 'duplicates = { window = "1s" }',
}
OPTION_TOOLS = "".join(
    f'\n[tools.{name}]\nclass = "key-and-status-check"\npython = "commitgate.server.demo.tools:charge_card"\n'
    f'status_check = "commitgate.server.demo.tools:find_charge"\ntimeout = "10s"\n{line}\n'
    for name, line in OPTIONS.items()
)


def deployment(
    root: Path, duplicates: str = "", principal: str | None = None, name: str = "policy.toml"
) -> Deployment:
    """A deployment serving charge_card with the given `duplicates = ...` line (empty: the defaults),
    and a charge tool for each option of OPTIONS."""
    made = Deployment.create(root, name=name, principal=principal)
    tools = TOOLS.format(duplicates=duplicates) + OPTION_TOOLS
    made.policy.write_text(policy_toml(principal=principal).replace(TOOLS_TOML, tools), encoding="utf-8")
    return made


@pytest.fixture(scope="module")
def shared_deployment(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    return deployment(tmp_path_factory.mktemp("duplicates-shared"))


@pytest.fixture(scope="module")
async def shared(shared_deployment: Deployment, anyio_backend: str) -> AsyncIterator[Server]:
    """One server for the tests that need no faults and no principal of their own."""
    async with serve(shared_deployment) as server:
        yield server


@pytest.fixture
def session() -> str:
    return new_id("run")


def charge(key: str, **extra: Any) -> dict[str, Any]:
    return {**CHARGE, "idempotency_key": key, **extra}


def charges(d: Deployment, **where: Any) -> int:
    return d.count("charges", **where)


def audit_events(d: Deployment, event: str, session: str) -> list[dict[str, Any]]:
    """Audit entries of one kind in one session, read from the ledger file itself."""
    with contextlib.closing(sqlite3.connect(d.ledger)) as conn:
        rows = conn.execute(
            "SELECT a.operation_id, a.detail, o.step FROM audit a JOIN operations o USING (operation_id)"
            " WHERE a.event = ? AND o.session = ?",
            (event, session),
        ).fetchall()
    return [{"operation_id": r[0], "detail": json.loads(r[1]) if r[1] else None, "step": r[2]} for r in rows]


def text_of(result: CallToolResult) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


# --- the default: on, session scope, reject ----------------------------------------------------------


@pytest.mark.anyio
async def test_a_fresh_key_repeat_is_refused_with_the_earlier_operation_and_charges_once(
    shared: Server, session: str
) -> None:
    d = shared.deployment
    first = await shared.call("charge_card", charge("order-42-a"), session=session)
    assert not first.is_error, first.content
    again = await shared.call("charge_card", charge("order-42-b"), session=session)

    assert error_code(again) == "possible_duplicate"
    detail = error(again)
    earlier = detail["duplicate_of"]
    assert earlier["operation_id"] == operation(first)["operation_id"]
    assert earlier["idempotency_key"] == "order-42-a"
    assert earlier["state"] == "SUCCEEDED" and earlier["retry_advice"] == "done"
    assert earlier["result"]["structuredContent"] == first.structured_content
    assert detail["operation"] is None  # nothing was recorded for the second key
    assert detail["message"] in text_of(again)  # the same explanation in the text and the structure
    assert charges(d, session=session) == 1
    status = await shared.status(session, idempotency_key="order-42-b")
    assert status == {"found": False, "operation": None}

    # A retry of the second call with its own key is still a duplicate, never a charge.
    assert error_code(await shared.call("charge_card", charge("order-42-b"), session=session)) == (
        "possible_duplicate"
    )
    # The first key still replays as always.
    replay = await shared.call("charge_card", charge("order-42-a"), session=session)
    assert operation(replay)["replayed"] is True
    assert charges(d, session=session) == 1


@pytest.mark.anyio
async def test_the_text_says_what_was_done_when_with_what_result_and_what_to_do(
    shared: Server, session: str
) -> None:
    first = await shared.call("charge_card", charge("order-7-a"), session=session)
    charge_id = first.structured_content["charge_id"]
    text = text_of(await shared.call("charge_card", charge("order-7-b"), session=session))
    assert text.startswith("[possible_duplicate] Possible duplicate: nothing was executed now.")
    assert "charge_card was already called with exactly these arguments" in text
    assert "under idempotency_key 'order-7-a'" in text
    assert f"in session '{session}'" in text
    assert "It succeeded with this result:" in text and charge_id in text
    assert "just now" in text or "seconds ago" in text
    assert (
        "If you are repeating that call because you did not see its answer, or lost track of it, do not call again"
        in text
    )
    assert (
        "Only if you deliberately want this same action a second time, call again with a new idempotency_key "
        "and confirm_duplicate: true." in text
    )


@pytest.mark.anyio
async def test_confirm_duplicate_lets_a_deliberate_second_action_through_and_audits_it(
    shared: Server, session: str
) -> None:
    d = shared.deployment
    tools = {t.name: t for t in (await shared.client.list_tools()).tools}
    schema = tools["charge_card"].input_schema
    assert schema["properties"]["confirm_duplicate"]["type"] == "boolean"
    assert "deliberately" in schema["properties"]["confirm_duplicate"]["description"]
    assert "confirm_duplicate" not in schema["required"]
    assert "confirm_duplicate" not in tools["get_balance"].input_schema.get("properties", {})

    first = await shared.call("charge_card", charge("twice-a"), session=session)
    bad = await shared.call("charge_card", charge("twice-b", confirm_duplicate="yes"), session=session)
    assert error_code(bad) == "invalid_arguments"
    assert "confirm_duplicate must be true or false" in error(bad)["message"]
    assert charges(d, session=session) == 1

    second = await shared.call("charge_card", charge("twice-b", confirm_duplicate=True), session=session)
    assert not second.is_error, second.content
    assert second.structured_content["charge_id"] != first.structured_content["charge_id"]
    assert charges(d, session=session) == 2
    # Not part of the fingerprint: the confirmed key replays with or without the flag.
    replay = await shared.call("charge_card", charge("twice-b"), session=session)
    assert operation(replay)["replayed"] is True
    # Never passed to the tool: the charge row holds only the tool's own arguments.
    assert {r["description"] for r in d.rows("charges", session=session)} == {"order 42"}
    assert charges(d, session=session) == 2
    (entry,) = audit_events(d, "possible_duplicate", session)
    assert entry["step"] == "twice-b"
    assert entry["detail"] == {"duplicate_of": operation(first)["operation_id"], "confirmed": True}


@pytest.mark.anyio
async def test_other_arguments_other_sessions_and_other_principals_are_not_duplicates(shared: Server) -> None:
    alice, s1, s2 = shared.deployment, new_id("s1"), new_id("s2")
    bob = deployment(alice.root, principal="bob", name="bob.toml")  # the same ledger and sandbox
    assert not (await shared.call("charge_card", charge("a-1"), session=s1)).is_error
    assert not (await shared.call("charge_card", charge("a-2", amount_cents=1300), session=s1)).is_error
    assert not (await shared.call("charge_card", charge("a-3"), session=s2)).is_error
    async with serve(bob) as server:
        assert not (await server.call("charge_card", charge("b-1"), session=s1)).is_error
    assert charges(alice, session=s1) + charges(alice, session=s2) == 4
    assert charges(alice, session=s1, principal="bob") == 1


# --- the options, each a tool of its own ----------------------------------------------------------------


@pytest.mark.anyio
async def test_scope_principal_catches_a_repeat_from_another_session(shared: Server) -> None:
    d, run, restarted = shared.deployment, new_id("run"), new_id("restarted-run")
    first = await shared.call("charge_in_principal", charge("p-1"), session=run)
    again = await shared.call("charge_in_principal", charge("p-2"), session=restarted)
    assert error_code(again) == "possible_duplicate"
    assert error(again)["duplicate_of"]["session"] == run
    assert error(again)["duplicate_of"]["operation_id"] == operation(first)["operation_id"]
    assert f"in session '{run}'" in text_of(again)
    assert charges(d, session=run) == 1 and charges(d, session=restarted) == 0


@pytest.mark.anyio
async def test_action_allow_executes_and_only_records_the_match(shared: Server, session: str) -> None:
    d = shared.deployment
    first = await shared.call("charge_allowing", charge("al-1"), session=session)
    second = await shared.call("charge_allowing", charge("al-2"), session=session)
    assert not second.is_error, second.content
    assert charges(d, session=session) == 2
    (entry,) = audit_events(d, "possible_duplicate", session)
    assert entry["step"] == "al-2"
    assert entry["detail"] == {"duplicate_of": operation(first)["operation_id"], "confirmed": False}


@pytest.mark.anyio
async def test_duplicates_false_turns_detection_off(shared: Server, session: str) -> None:
    tools = {t.name: t for t in (await shared.client.list_tools()).tools}
    assert "confirm_duplicate" not in tools["charge_unchecked"].input_schema["properties"]
    for key in ("off-1", "off-2", "off-3"):
        assert not (await shared.call("charge_unchecked", charge(key), session=session)).is_error
    assert charges(shared.deployment, session=session) == 3
    assert audit_events(shared.deployment, "possible_duplicate", session) == []


@pytest.mark.anyio
async def test_a_repeat_after_the_window_is_a_new_action(shared: Server, session: str) -> None:
    assert not (await shared.call("charge_briefly", charge("w-1"), session=session)).is_error
    assert (
        error_code(await shared.call("charge_briefly", charge("w-2"), session=session))
        == "possible_duplicate"
    )
    await anyio.sleep(1.2)  # past the window: the earlier charge no longer counts
    assert not (await shared.call("charge_briefly", charge("w-3"), session=session)).is_error
    assert charges(shared.deployment, session=session) == 2


# --- atomic under concurrency ------------------------------------------------------------------------------

CONCURRENT = 12  # calls, each with its own fresh key, split over two server processes


async def fresh_keys_together(servers: list[Server], session: str) -> list[CallToolResult]:
    results: list[CallToolResult] = []

    async def one(server: Server, key: str) -> None:
        results.append(await server.call("charge_card", charge(key), session=session))

    async with anyio.create_task_group() as tg:
        for i in range(CONCURRENT):
            tg.start_soon(one, servers[i % len(servers)], new_id(f"fresh-{i}"))
    return results


def assert_exactly_one_went_through(results: list[CallToolResult]) -> None:
    codes = sorted(str(error_code(r)) for r in results)
    assert codes == ["None"] + ["possible_duplicate"] * (CONCURRENT - 1), codes
    (winner,) = [r for r in results if not r.is_error]
    for refused in (r for r in results if r.is_error):
        assert error(refused)["duplicate_of"]["operation_id"] == operation(winner)["operation_id"]


@pytest.mark.anyio
async def test_n_concurrent_fresh_keys_on_one_sqlite_ledger_charge_once(tmp_path: Path) -> None:
    d = deployment(tmp_path)
    slow = "charge_card.latency=300ms"  # the copies arrive while the first is still running
    async with together(serve(d, faults=slow), serve(d, faults=slow)) as servers:
        results = await fresh_keys_together(servers, "burst")
    assert_exactly_one_went_through(results)
    assert charges(d) == 1


@contextlib.asynccontextmanager
async def serve_on(d: Deployment, ledger_url: str, faults: str = "") -> AsyncIterator[Server]:
    """`commitgate serve` on the deployment's policy and sandbox, with another ledger (PostgreSQL)."""
    args = ["serve", "--policy", str(d.policy), "--ledger", ledger_url]
    params = StdioServerParameters(command=str(CONSOLE_SCRIPT), args=args, env=d.env(faults))
    log = d.root / f"server-{new_id('pg')}.stderr"
    with log.open("w", encoding="utf-8") as errlog:
        async with Client(stdio_client(params, errlog=errlog), read_timeout_seconds=30) as client:
            yield Server(client, d, "", log)


@pytest.mark.anyio
@pytest.mark.postgres
async def test_n_concurrent_fresh_keys_on_one_postgres_ledger_charge_once(tmp_path: Path) -> None:
    from support.postgres import fresh_url

    url = await fresh_url()
    d = deployment(tmp_path)
    slow = "charge_card.latency=300ms"
    async with together(serve_on(d, url, slow), serve_on(d, url, slow)) as (one, two):
        results = await fresh_keys_together([one, two], "burst")
        assert_exactly_one_went_through(results)
        # scope and window behave as on SQLite: another session is another action
        assert not (await one.call("charge_card", charge("other-session"), session="elsewhere")).is_error
    assert charges(d) == 2


def test_policy_check_explains_bad_duplicates_options(tmp_path: Path) -> None:
    bad, long = tmp_path / "bad.toml", tmp_path / "long.toml"
    bad.write_text(
        TOOLS.format(
            duplicates='duplicates = { window = "10x", scope = "sesion", action = "ask", windw = 1 }'
        ),
        encoding="utf-8",
    )
    long.write_text(
        '[server]\nretention = "1h"\n' + TOOLS.format(duplicates='duplicates = { window = "2h" }'),
        encoding="utf-8",
    )
    check = [str(CONSOLE_SCRIPT), "policy", "check"]
    checked, long_checked = run_together([*check, str(bad)], [*check, str(long)])
    assert checked.returncode == 1
    out = checked.stdout
    assert "tools.charge_card.duplicates.window: invalid duration '10x'" in out
    assert "tools.charge_card.duplicates.scope: must be 'session' or 'principal'" in out
    assert "tools.charge_card.duplicates.action: must be 'reject', 'approval' or 'allow'" in out
    assert "tools.charge_card.duplicates.windw: unknown key; did you mean 'window'?" in out
    assert "(line 7)" in out
    assert "Traceback" not in checked.stderr

    long_out = long_checked.stdout
    assert long_checked.returncode == 0, long_out
    assert (
        "warning: tools.charge_card.duplicates.window: 2h is longer than the tool's retention (1h)"
        in long_out
    )
