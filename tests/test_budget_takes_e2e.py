"""Approved is not a blank cheque: budgets end to end, through real `commitgate serve` processes.

A budgeted call that waits for approval spends when it is taken to run, not when it is created
or approved: the ledger checks its budget again with the take, atomically (SQLite and
PostgreSQL), so ten approved charges of the whole limit charge once, and a call approved after
the window is placed in the window at its take. A repeat of a charge that already ran hears
`possible_duplicate`, not `budget_exceeded`. The agent's own client, however willing, never
approves an overspend or its own duplicates. Amounts add up as exact decimals, shown with the
budget's unit. Charges are counted in the demo payments store.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from mcp.types import CallToolResult
from support.e2e import (
    CONSOLE_SCRIPT,
    TOOLS_TOML,
    Deployment,
    error,
    error_code,
    policy_toml,
    serve,
    together,
)
from test_approvals_e2e import person

from commitgate.server.core import approvals
from commitgate.server.ledger import open_ledger

pytestmark = pytest.mark.slow

TOOLS = """
[budgets.payments]
amount = "{amount}"
limit = {limit}
window = "1h"
per = "principal"
exceeded = "{exceeded}"
unit = "{unit}"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
timeout = "10s"
retry = {{ attempts = 1 }}
budget = "payments"
{extra}
"""


def deployment(
    root: Path,
    *,
    limit: str = "1000",
    exceeded: str = "reject",
    extra: str = "",
    amount: str = "arguments.amount_cents",
    unit: str = "USD cents",
) -> Deployment:
    made = Deployment.create(root)
    tools = TOOLS.format(amount=amount, limit=limit, exceeded=exceeded, extra=extra, unit=unit)
    made.policy.write_text(policy_toml().replace(TOOLS_TOML, tools), encoding="utf-8")
    return made


NOTES = """
[tools.send_note]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
duplicates = { action = "approval" }
"""
NOTE = {"to": "ann@example.com", "subject": "Ticket", "body": "The printer is out of paper"}


def charge(key: str, cents: int) -> dict[str, Any]:
    return {"card": "4242", "amount_cents": cents, "description": key, "idempotency_key": key}


def text(result: CallToolResult) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    from support.postgres import fresh_url

    yield await fresh_url()


async def approve_all(url: str, operation_ids: list[str]) -> None:
    """An operator approves each, as `commitgate ops approve` does, on the ledger the servers share."""
    ledger = await open_ledger(url)
    try:
        for operation_id in operation_ids:
            await approvals.decide(
                ledger, operation_id, "approve", by="anna", via="operator", reason=None, now=time.time()
            )
    finally:
        await ledger.close()


async def backdate(url: str, seconds: float) -> None:
    """Every operation recorded `seconds` earlier: as if it had waited that long for its approval."""
    if url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            conn.execute("UPDATE operations SET created_at = created_at - ?", (seconds,))
        return
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE commitgate_operations SET created_at = created_at - $1", seconds)
    finally:
        await conn.close()


# --- the take re-checks the budget, on SQLite and PostgreSQL ------------------------------------------


@pytest.mark.anyio
async def test_ten_approved_charges_of_the_whole_limit_charge_once(tmp_path: Path, ledger_url: str) -> None:
    d = deployment(tmp_path, extra='approval = { via = ["operator"] }')
    keys = [f"c{i}" for i in range(10)]
    async with together(serve(d, ledger=ledger_url), serve(d, ledger=ledger_url)) as (one, two):
        waiting = [await one.call("charge_card", charge(key, 1000), session="s") for key in keys]
        assert {error_code(w) for w in waiting} == {"approval_pending"}
        await approve_all(ledger_url, [error(w)["operation"]["operation_id"] for w in waiting])
        results: dict[str, CallToolResult] = {}

        async def run(i: int, key: str) -> None:
            results[key] = await (one, two)[i % 2].call("charge_card", charge(key, 1000), session="s")

        async with anyio.create_task_group() as group:
            for i, key in enumerate(keys):
                group.start_soon(run, i, key)
        codes = sorted(str(error_code(r)) for r in results.values())
        assert codes == ["None"] + ["budget_exceeded"] * 9, codes
        (winner,) = [key for key, r in results.items() if not r.is_error]
        loser = next(key for key, r in results.items() if r.is_error)
        refused = error(results[loser])
        assert refused["operation"]["state"] == "FAILED_FINAL"
        assert refused["budget"] == {
            "name": "payments", "limit": 1000, "spent": 1000, "window": "1h", "unit": "USD cents",
        }  # fmt: skip
        assert "approved, then refused when it was about to run" in refused["message"]
        assert "0 USD cents is left" in refused["message"]
        again = await two.call("charge_card", charge(loser, 1000), session="s")  # every replay says so
        assert error_code(again) == "budget_exceeded" and error(again)["budget"] == refused["budget"]
        # a repeat of the charge that ran, under a fresh key: it happened, whatever the budget says
        repeat = await one.call(
            "charge_card", {**charge(winner, 1000), "idempotency_key": "new"}, session="s"
        )
        assert error_code(repeat) == "possible_duplicate", text(repeat)
    assert d.count("charges") == 1 and d.count("charges", description=winner) == 1


@pytest.mark.anyio
async def test_a_charge_approved_after_its_window_counts_from_its_take(
    tmp_path: Path, ledger_url: str
) -> None:
    d = deployment(
        tmp_path, extra='approval = { when = "arguments.amount_cents >= 1000", via = ["operator"] }'
    )
    async with serve(d, ledger=ledger_url) as server:
        late = await server.call("charge_card", charge("late", 1000), session="s")
        assert error_code(late) == "approval_pending"
        await backdate(ledger_url, 7200.0)  # it waited two hours, twice the window
        await approve_all(ledger_url, [error(late)["operation"]["operation_id"]])
        assert not (await server.call("charge_card", charge("late", 1000), session="s")).is_error
        beside = await server.call("charge_card", charge("beside", 999), session="s")
        assert error_code(beside) == "budget_exceeded", text(beside)
        assert error(beside)["budget"]["spent"] == 1000
    assert d.count("charges") == 1


# --- the agent's client never decides a cap or its own repeats --------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["legacy", "auto"])  # handshake era (elicitation/create), 2026-07-28
async def test_a_client_that_accepts_everything_cannot_approve_its_own_overspend_or_duplicates(
    tmp_path: Path, mode: str
) -> None:
    d = deployment(
        tmp_path,
        exceeded="approval",
        extra='approval = { when = "arguments.amount_cents >= 500", via = ["client", "operator"] }\n'
        + NOTES,  # a tool without an approval table whose duplicates go to a person
    )
    asked: list[str] = []
    async with serve(d, mode=mode, elicitation_callback=person("accept", asked)) as server:
        assert not (await server.call("charge_card", charge("small", 400), session="s")).is_error
        asked_for = await server.call("charge_card", charge("asked", 600), session="s")
        assert not asked_for.is_error, text(asked_for)  # within the budget: the client's user may say yes
        (question,) = asked
        assert (
            "Budget 'payments': limit 1000 USD cents, spent 400 USD cents, left 600 USD cents; "
            "this call spends 600 USD cents." in question
        ), question
        over = await server.call("charge_card", charge("over", 700), session="s")
        assert error_code(over) == "approval_pending", text(over)
        assert len(asked) == 1  # the overspend was never put to the client
        status = (await server.status("s", idempotency_key="over"))["operation"]
        assert status["approval"]["over_budget"] == {
            "name": "payments", "limit": 1000, "spent": 1000, "amount": 700, "unit": "USD cents",
        }  # fmt: skip
        for key in ("n1", "n2", "n3"):  # the same note under fresh keys: the repeats wait for an operator
            result = await server.call("send_note", {**NOTE, "idempotency_key": key}, session="s")
            assert (result.is_error, error_code(result)) == (
                (False, None) if key == "n1" else (True, "approval_pending")
            ), text(result)
        assert len(asked) == 1
    assert d.count("charges") == 2 and d.count("emails") == 1


# --- exact decimals, with the unit ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_three_tenths_fit_a_limit_of_three_tenths_and_ops_budgets_says_none_is_left(
    tmp_path: Path,
) -> None:
    d = deployment(tmp_path, limit="0.3", amount="double(arguments.amount_cents) / 10.0", unit="USD")
    async with serve(d) as server:
        for key in ("d1", "d2", "d3"):
            assert not (await server.call("charge_card", charge(key, 1), session="s")).is_error
        fourth = await server.call("charge_card", charge("d4", 1), session="s")
        assert error_code(fourth) == "budget_exceeded", text(fourth)
        assert error(fourth)["budget"] == {
            "name": "payments",
            "limit": 0.3,
            "spent": 0.3,
            "window": "1h",
            "unit": "USD",
        }
        assert "would spend 0.1 USD" in text(fourth) and "0 USD is left" in text(fourth)
    shown = subprocess.run(
        [
            str(CONSOLE_SCRIPT),
            "ops",
            "budgets",
            "--policy",
            str(d.policy),
            "--ledger",
            f"sqlite:///{d.ledger}",
        ],
        capture_output=True,
        text=True,
        env={**d.env(), "COLUMNS": "200"},
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    (line,) = [line for line in shown.stdout.splitlines() if "payments" in line]
    cells = [cell.strip() for cell in line.split("│") if cell.strip()]
    assert cells[3:6] == ["0.3 USD", "0.3 USD", "0 USD"], cells
    assert d.count("charges") == 3
