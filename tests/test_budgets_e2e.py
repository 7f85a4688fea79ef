"""Budgets end to end: real `commitgate serve` processes over stdio, charges counted in the sandbox.

A call that would take its budget past the limit answers `budget_exceeded` with the budget,
charges nothing and records nothing. Of concurrent calls that together would overspend, only
those that fit go through, on SQLite and on PostgreSQL (server processes sharing one ledger).
Failed and compensated charges give their amount back, spending leaves with the window, each
principal has its own budget, an amount that is not a number is refused, and `commitgate ops
budgets` shows what was spent. With `exceeded = "approval"` a charge past the limit waits for
`commitgate ops approve|deny` instead: approved, it charges once; denied, never.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
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
from test_duplicates_e2e import serve_on

from commitgate.client import BudgetExceeded, Gate
from commitgate.server.demo.tools import DECLINED_CARD

pytestmark = pytest.mark.slow

LIMIT = 3000

TOOLS = """
[budgets.payments]
amount = "{amount}"
limit = {limit}
window = "{window}"
per = "principal"
exceeded = "{exceeded}"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
timeout = "10s"
retry = {{ attempts = 1 }}
budget = "payments"

[tools.pay_booking]
class = "compensable"
python = "commitgate.server.demo.tools:charge_card"
compensate = {{ tool = "refund", arguments = {{ charge_id = "{{result.charge_id}}", amount_cents = "{{arguments.amount_cents}}" }} }}
budget = "payments"

[tools.refund]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:refund"
status_check = "commitgate.server.demo.tools:find_refund"
expose = false
"""


def deployment(
    root: Path,
    *,
    limit: int = LIMIT,
    window: str = "1h",
    amount: str = "arguments.amount_cents",
    principal: str | None = None,
    name: str = "policy.toml",
    exceeded: str = "reject",
) -> Deployment:
    made = Deployment.create(root, name=name, principal=principal)
    tools = TOOLS.format(amount=amount, limit=limit, window=window, exceeded=exceeded)
    made.policy.write_text(policy_toml(principal=principal).replace(TOOLS_TOML, tools), encoding="utf-8")
    return made


def charge(key: str, cents: int, **extra: Any) -> dict[str, Any]:
    return {"card": "4242", "amount_cents": cents, "description": key, "idempotency_key": key, **extra}


def charged(d: Deployment) -> int:
    """Cents charged and not refunded, as the payments store holds them."""
    total = sum(int(row["amount_cents"]) for row in d.rows("charges"))
    return total - sum(int(row["amount_cents"]) for row in d.rows("refunds"))


def assert_refused(result: CallToolResult, spent: int, limit: int = LIMIT, window: str = "1h") -> None:
    assert error_code(result) == "budget_exceeded", result.content
    detail = error(result)
    assert detail["budget"] == {"name": "payments", "limit": limit, "spent": spent, "window": window}
    assert detail["operation"] is None


# --- refused, nothing charged or recorded ---------------------------------------------------------------


@pytest.mark.anyio
async def test_a_charge_past_the_limit_is_refused_charges_nothing_and_records_nothing(tmp_path: Path) -> None:
    d = deployment(tmp_path)
    async with serve(d) as server:
        assert not (await server.call("charge_card", charge("c1", 2000), session="s")).is_error
        refused = await server.call("charge_card", charge("c2", 1500), session="s")
        assert_refused(refused, spent=2000)
        text = " ".join(getattr(block, "text", "") for block in refused.content)
        assert text.startswith("[budget_exceeded] Budget exceeded: nothing was executed or recorded.")
        assert "1000 is left" in text
        assert await server.status("s", idempotency_key="c2") == {"found": False, "operation": None}
        # the same key is refused again, not remembered as a failure; a call that fits goes through
        assert_refused(await server.call("charge_card", charge("c2", 1500), session="s"), spent=2000)
        assert not (await server.call("charge_card", charge("c3", 1000), session="s")).is_error
        assert_refused(await server.call("pay_booking", charge("p1", 1), session="s"), spent=3000)
    assert d.count("charges") == 2 and charged(d) == 3000


# --- exceeded = "approval": a person decides whether to spend past the limit --------------------------


def ops(d: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    """`commitgate ops ...` as an operator runs it: another process, the same ledger file."""
    command = [str(CONSOLE_SCRIPT), "ops", *args, "--ledger", f"sqlite:///{d.ledger}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=d.env())


@pytest.mark.anyio
async def test_past_the_limit_a_person_decides_approved_charges_once_denied_never(tmp_path: Path) -> None:
    d = deployment(tmp_path, exceeded="approval")
    async with serve(d) as server:
        assert not (await server.call("charge_card", charge("c1", 2000), session="s")).is_error
        waiting = await server.call("charge_card", charge("c2", 1500), session="s")
        assert error_code(waiting) == "approval_pending", waiting.content
        text = " ".join(getattr(block, "text", "") for block in waiting.content)
        assert "would take budget 'payments' past its limit" in text
        assert d.count("charges") == 1  # nothing runs before a person says yes
        status = (await server.status("s", idempotency_key="c2"))["operation"]
        assert status["state"] == "AWAITING_APPROVAL" and status["retry_advice"] == "wait_and_poll"
        over = {"name": "payments", "limit": LIMIT, "spent": 2000, "amount": 1500}
        assert status["approval"]["over_budget"] == over
        op_id = status["operation_id"]
        # waiting, it does not count: a charge that fits still goes through
        assert not (await server.call("charge_card", charge("c3", 1000), session="s")).is_error
        assert error_code(await server.call("charge_card", charge("c2", 1500), session="s")) == (
            "approval_pending"
        )
        assert d.count("charges") == 2

        shown = ops(d, "show", op_id, "--json")
        assert shown.returncode == 0, shown.stderr
        assert '"over_budget"' in shown.stdout and '"budget_exceeded"' in shown.stdout  # view and audit
        approved = ops(d, "approve", op_id, "--reason", "the customer's order is worth it", "--by", "anna")
        assert approved.returncode == 0, approved.stderr
        results = [await server.call("charge_card", charge("c2", 1500), session="s") for _ in range(3)]
        assert [r.is_error for r in results] == [False] * 3, [r.content for r in results]
        assert d.count("charges") == 3 and d.count("charges", description="c2") == 1
        assert charged(d) == 4500  # approved knowingly past the limit of 3000

        denied_call = await server.call("charge_card", charge("c4", 100), session="s")
        assert error_code(denied_call) == "approval_pending"
        denied_id = operation(denied_call)["operation_id"]
        assert ops(d, "deny", denied_id, "--reason", "over budget", "--by", "anna").returncode == 0
        after = await server.call("charge_card", charge("c4", 100), session="s")
        assert error_code(after) == "approval_denied", after.content
    assert d.count("charges") == 3 and d.count("charges", description="c4") == 0


# --- atomic under concurrency ------------------------------------------------------------------------------

CONCURRENT = 10


async def at_once(servers: list[Server], cents: int) -> list[CallToolResult]:
    results: list[CallToolResult] = []

    async def one(server: Server, key: str) -> None:
        results.append(await server.call("charge_card", charge(key, cents), session="burst"))

    async with anyio.create_task_group() as tg:
        for i in range(CONCURRENT):
            tg.start_soon(one, servers[i % len(servers)], new_id(f"c{i}"))
    return results


def assert_never_over(results: list[CallToolResult], d: Deployment) -> None:
    """10 calls of 700 against 3000: exactly four fit; the other six see the four spent."""
    codes = sorted(str(error_code(r)) for r in results)
    assert codes == ["None"] * 4 + ["budget_exceeded"] * 6, codes
    for refused in (r for r in results if r.is_error):
        assert error(refused)["budget"]["spent"] == 2800
    assert d.count("charges") == 4 and charged(d) == 2800


@pytest.mark.anyio
async def test_concurrent_charges_on_one_sqlite_ledger_never_pass_the_limit(tmp_path: Path) -> None:
    d = deployment(tmp_path)
    slow = "charge_card.latency=300ms"  # the calls overlap while the first ones still run
    async with together(serve(d, faults=slow), serve(d, faults=slow)) as servers:
        assert_never_over(await at_once(servers, 700), d)


@pytest.mark.anyio
@pytest.mark.postgres
async def test_concurrent_charges_on_one_postgres_ledger_never_pass_the_limit(tmp_path: Path) -> None:
    from support.postgres import fresh_url

    url = await fresh_url()
    d = deployment(tmp_path)
    slow = "charge_card.latency=300ms"
    async with together(serve_on(d, url, slow), serve_on(d, url, slow)) as (one, two):
        assert_never_over(await at_once([one, two], 700), d)
        # the window and the states count as on SQLite: a declined charge ran, so it keeps its amount
        failed = await one.call(
            "charge_card", {**charge("declined", 200), "card": DECLINED_CARD}, session="x"
        )
        assert error_code(failed) == "operation_failed"
        assert_refused(await two.call("charge_card", charge("last", 200), session="x"), spent=3000)
    assert charged(d) == 2800


# --- what counts ------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_declined_charge_keeps_its_amount_and_a_compensated_one_gives_it_back(tmp_path: Path) -> None:
    """A budget gives back only what certainly did not run or was undone: the declined charge ran."""
    d = deployment(tmp_path)
    async with serve(d) as server:
        failed = await server.call(
            "charge_card", {**charge("f1", 1000), "card": DECLINED_CARD}, session="trip"
        )
        assert error_code(failed) == "operation_failed"
        assert not (await server.call("pay_booking", charge("p1", 2000), session="trip")).is_error
        assert_refused(await server.call("charge_card", charge("c1", 500), session="other"), spent=3000)
        undone = await server.call("compensate_session", {"reason": "trip cancelled"}, session="trip")
        assert not undone.is_error and undone.structured_content is not None
        assert undone.structured_content["state"] == "COMPLETED"
        assert_refused(await server.call("charge_card", charge("c1", 2001), session="other"), spent=1000)
        assert not (await server.call("charge_card", charge("c1", 2000), session="other")).is_error
    assert d.count("charges") == 2 and d.count("refunds") == 1 and charged(d) == 2000


@pytest.mark.anyio
async def test_spending_leaves_the_budget_with_the_window(tmp_path: Path) -> None:
    d = deployment(tmp_path, window="2s")
    async with serve(d) as server:
        assert not (await server.call("charge_card", charge("w1", 3000), session="s")).is_error
        assert_refused(
            await server.call("charge_card", charge("w2", 1), session="s"), spent=3000, window="2s"
        )
        await anyio.sleep(2.2)
        assert not (await server.call("charge_card", charge("w2", 1), session="s")).is_error
    assert d.count("charges") == 2


@pytest.mark.anyio
async def test_each_principal_has_a_budget_of_its_own(tmp_path: Path) -> None:
    alice = deployment(tmp_path)
    bob = deployment(tmp_path, principal="bob", name="bob.toml")
    async with together(serve(alice), serve(bob)) as (a, b):
        assert not (await a.call("charge_card", charge("a1", 3000), session="s")).is_error
        assert not (await b.call("charge_card", charge("b1", 3000), session="s")).is_error
        assert_refused(await a.call("charge_card", charge("a2", 1), session="other"), spent=3000)
        assert_refused(await b.call("charge_card", charge("b2", 1), session="s"), spent=3000)
    assert alice.count("charges") == 2


BAD_AMOUNTS = {  # a budget (and a charge tool spending from it) per amount no call can be charged
    "by_description": "arguments.description",
    "below_zero": "arguments.amount_cents",
    "times_a_float": "arguments.amount_cents * 2.5",
}


@pytest.fixture(scope="module")
async def bad_amounts(tmp_path_factory: pytest.TempPathFactory, anyio_backend: str) -> AsyncIterator[Server]:
    """One server for the amounts that are not a number, each with a budget and a tool of its own."""
    made = Deployment.create(tmp_path_factory.mktemp("bad-amounts"))
    tools = "".join(
        f'\n[budgets.{name}]\namount = "{amount}"\nlimit = {LIMIT}\nwindow = "1h"\nper = "principal"\n'
        f'\n[tools.charge_{name}]\nclass = "key-and-status-check"\npython = "commitgate.server.demo.tools:charge_card"\n'
        f'status_check = "commitgate.server.demo.tools:find_charge"\nbudget = "{name}"\n'
        for name, amount in BAD_AMOUNTS.items()
    )
    made.policy.write_text(policy_toml().replace(TOOLS_TOML, tools), encoding="utf-8")
    async with serve(made) as server:
        yield server


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("budget", "arguments", "says"),
    [
        ("by_description", charge("bad-1", 100), "needs a number for what this call spends"),
        ("below_zero", charge("bad-2", -100), "must be a finite number >= 0, got -100"),
        ("times_a_float", charge("bad-3", 100), "could not work out what this call spends"),
    ],
)
async def test_an_amount_that_is_not_a_number_is_refused_and_nothing_is_recorded(
    bad_amounts: Server, budget: str, arguments: dict[str, Any], says: str
) -> None:
    refused = await bad_amounts.call(f"charge_{budget}", arguments, session="s")
    assert error_code(refused) == "invalid_arguments"
    assert says in error(refused)["message"] and f"budget '{budget}'" in error(refused)["message"]
    assert await bad_amounts.operations() == []  # nothing recorded, and the server still answers
    assert bad_amounts.deployment.count("charges") == 0


@pytest.mark.anyio
async def test_the_client_raises_budget_exceeded_with_the_budget(tmp_path: Path) -> None:
    d = deployment(tmp_path)
    async with serve(d) as server:
        gate = Gate(server.client, session="run-1")
        await gate.call("charge_card", {"card": "4242", "amount_cents": 2500}, step="first")
        with pytest.raises(BudgetExceeded) as over:
            await gate.call("charge_card", {"card": "4242", "amount_cents": 600}, step="second")
    assert over.value.code == "budget_exceeded" and over.value.operation is None
    assert over.value.budget == {"name": "payments", "limit": LIMIT, "spent": 2500, "window": "1h"}
    assert d.count("charges") == 1


# --- commitgate ops budgets --------------------------------------------------------------------------------


def ops_budgets(d: Deployment, *runs: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """`commitgate ops budgets` once for each list of extra arguments, side by side."""
    args = [
        str(CONSOLE_SCRIPT),
        "ops",
        "budgets",
        "--policy",
        str(d.policy),
        "--ledger",
        f"sqlite:///{d.ledger}",
    ]
    return run_together(*([*args, *extra] for extra in runs), env={**d.env(), "COLUMNS": "200"})


@pytest.mark.anyio
async def test_ops_budgets_shows_spent_and_limit_per_scope_and_only_reads(tmp_path: Path) -> None:
    d = deployment(tmp_path, principal="alice")
    bob = deployment(tmp_path, principal="bob", name="bob.toml")
    (missing,) = ops_budgets(d, [])
    assert missing.returncode == 1 and "no ledger at" in missing.stderr
    assert not d.ledger.exists()  # a read-only command never creates the ledger
    async with together(serve(d), serve(bob)) as (a, b):
        assert not (await a.call("charge_card", charge("a1", 1200), session="s")).is_error
        assert not (await a.call("pay_booking", charge("a2", 300), session="t")).is_error
        assert not (await b.call("charge_card", charge("b1", 2500), session="s")).is_error
    done, table = ops_budgets(d, ["--json"], [])
    assert done.returncode == 0, done.stderr
    (budget,) = json.loads(done.stdout)["budgets"]
    assert {k: budget[k] for k in ("name", "limit", "window", "per", "tools", "amount")} == {
        "name": "payments",
        "limit": LIMIT,
        "window": "1h",
        "per": "principal",
        "tools": ["charge_card", "pay_booking"],
        "amount": "arguments.amount_cents",
    }
    assert budget["scopes"] == [
        {"scope": "bob", "principal": "bob", "session": None, "spent": 2500, "left": 500, "operations": 1},
        {
            "scope": "alice",
            "principal": "alice",
            "session": None,
            "spent": 1500,
            "left": 1500,
            "operations": 2,
        },
    ]
    assert table.returncode == 0, table.stderr
    lines = [line for line in table.stdout.splitlines() if "payments" in line]
    assert len(lines) == 2
    assert all(w in lines[0] for w in ("bob", "2500", "3000", "500", "1h")), lines[0]
