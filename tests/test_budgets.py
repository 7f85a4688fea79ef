"""Budgets: the policy, the ledger's atomic check-and-claim (every backend), and the boundary.

The ledger adds up the amounts of a budget's recent operations in scope inside the claim and
claims only what fits; these tests hold every backend to that, including concurrent claims that
together would overspend. End-to-end behaviour through server processes is in test_budgets_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sqlite3
from decimal import Decimal
from pathlib import Path

import pytest
from support.boundary import FakeClock, ScriptedTool, SystemOfRecord, guarded, make_boundary
from support.ledgers import sqlite_back_to_version_7
from test_ledger_contract import RESULT, T0, finish, request

from commitgate.server.core.budgets import Budget
from commitgate.server.core.requests import CallRequest, GuardedTool
from commitgate.server.ledger.base import (
    BudgetCheck,
    ClaimKind,
    ClaimRequest,
    DuplicateCheck,
    Ledger,
    OverBudget,
)
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.ledger.sqlite._writes import BUDGET_SUMS
from commitgate.server.model.amounts import amount as exact
from commitgate.server.model.facts import ErrorCode, State
from commitgate.server.model.notes import ErrorRecord
from commitgate.server.policy.budgets import BudgetPolicy
from commitgate.server.policy.loading import analyse_text, loads_policy

# --- the policy -------------------------------------------------------------------------------------

POLICY = """
[budgets.payments]
amount = "arguments.amount_cents"
limit = 100000
window = "30d"
per = "principal"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
budget = "payments"
"""


def problems(text: str) -> list[str]:
    return [str(p) for p in analyse_text(text).problems]


def test_a_budget_and_a_tool_that_spends_from_it_load() -> None:
    policy = loads_policy(POLICY)
    budget = policy.budgets["payments"]
    assert (budget.limit, budget.window, budget.per, budget.exceeded) == (
        100000,
        30 * 86400.0,
        "principal",
        "reject",
    )
    assert budget.amount.source == "arguments.amount_cents"
    assert policy.tools["charge_card"].budget == "payments"
    assert policy.budget_of("charge_card") is budget
    # its records are kept for the whole window, so the sum finds them all
    assert policy.retention_for("charge_card") == 30 * 86400.0


def test_a_tool_must_name_a_declared_budget_with_its_line_and_a_suggestion() -> None:
    found = problems(POLICY.replace('budget = "payments"', 'budget = "paymnts"'))
    assert found == [
        "tools.charge_card.budget: no [budgets.paymnts] is declared; did you mean 'payments'? (line 12)"
    ]
    found = problems(POLICY.replace('budget = "payments"', 'budget = "travel"'))
    assert found == [
        "tools.charge_card.budget: no [budgets.travel] is declared (declared: 'payments') (line 12)"
    ]


def test_only_keyed_tools_spend_a_budget() -> None:
    text = (
        POLICY
        + '\n[tools.get_balance]\nclass = "safe-retry"\npython = "commitgate.server.demo.tools:get_balance"\nbudget = "payments"\n'
    )
    (found,) = problems(text)
    assert found.startswith("tools.get_balance.budget: safe-retry tools are not recorded")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('amount = "arguments.amount_cents +"', "budgets.payments.amount: is not valid CEL"),
        ('amount = "argumentz.amount_cents"', "budgets.payments.amount: unknown name 'argumentz'"),
        ("limit = -5", "budgets.payments.limit: must be >= 0"),
        ('limit = "lots"', "budgets.payments.limit"),
        ('window = "30 days"', "budgets.payments.window: invalid duration '30 days'"),
        ('per = "person"', "budgets.payments.per: must be 'principal', 'session' or 'all'"),
        ('exceeded = "ignore"', "budgets.payments.exceeded: must be 'reject' or 'approval'"),
        ("windw = 1", "budgets.payments.windw: unknown key; did you mean 'window'?"),
    ],
)
def test_policy_check_says_what_is_wrong_with_a_budget_and_where(line: str, expected: str) -> None:
    key = line.split(" = ")[0]
    lines = [f for f in POLICY.splitlines() if not f.startswith(f"{key} = ")]
    lines.insert(2, line)
    (found,) = problems("\n".join(lines))
    assert found.startswith(expected), found
    assert found.endswith("(line 3)"), found


def test_policy_show_lists_budgets_and_its_json_loads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from support.policy import run

    from commitgate.server.policy.models import Policy

    path = tmp_path / "policy.toml"
    path.write_text(POLICY, encoding="utf-8")
    shown = run(capsys, ["policy", "show", str(path)])
    assert shown.code == 0
    line = next(line for line in shown.out.splitlines() if "payments" in line and "arguments" in line)
    assert all(
        word in line for word in ("arguments.amount_cents", "100000", "30d", "principal", "charge_card")
    )
    assert "30d (the window of budget payments)" in " ".join(
        shown.out.split()
    )  # the records are kept for the window
    dumped = json.loads(run(capsys, ["policy", "show", "--json", str(path)]).out)
    assert dumped["budgets"]["payments"] == {
        "amount": "arguments.amount_cents",
        "limit": 100000,
        "window": "30d",
        "per": "principal",
        "exceeded": "reject",
    }
    assert Policy.model_validate(dumped).budgets == loads_policy(POLICY).budgets


def test_budget_names_are_checked() -> None:
    text = POLICY.replace("[budgets.payments]", '[budgets."pay ments"]').replace(
        'budget = "payments"', 'budget = "pay ments"'
    )
    assert problems(text) == [
        "budgets.\"pay ments\": budget names are 1-128 characters of letters, digits, '_', '-', '.' (line 2)"
    ]


# --- the ledger: sum and claim in one step (every backend) ---------------------------------------

LIMIT = BudgetCheck(
    name="payments", per="principal", amount=Decimal(400), limit=Decimal(1000), window_seconds=3600.0
)


def spending(step: str, amount: float = 400.0, check: BudgetCheck = LIMIT, **kw: object) -> ClaimRequest:
    budget = dataclasses.replace(check, amount=exact(amount))
    return dataclasses.replace(request(step, fingerprint=f"fp-{step}", **kw), budget=budget)  # type: ignore[arg-type]


async def spend(ledger: Ledger, step: str, amount: float = 400.0, now: float = T0, **kw: object) -> str:
    claim = await ledger.claim(spending(step, amount, **kw), now)  # type: ignore[arg-type]
    assert claim.kind is ClaimKind.NEW, claim
    return claim.operation.operation_id


async def refused(ledger: Ledger, step: str, amount: float = 400.0, now: float = T0, **kw: object) -> Decimal:
    with pytest.raises(OverBudget) as over:
        await ledger.claim(spending(step, amount, **kw), now)  # type: ignore[arg-type]
    return over.value.spent


@pytest.mark.anyio
async def test_a_claim_that_would_pass_the_limit_is_refused_and_records_nothing(ledger: Ledger) -> None:
    await spend(ledger, "k1")
    await spend(ledger, "k2")
    assert await refused(ledger, "k3") == 800.0
    assert await ledger.get("alice", "s1", "k3") is None
    await spend(ledger, "k4", 200.0)  # exactly up to the limit is allowed
    assert await refused(ledger, "k5", 0.5) == 1000.0
    await spend(ledger, "k6", 0.0)
    counts = await ledger.counts()
    assert counts.states["RUNNING"] == 4 and counts.events["claimed"] == 4


@pytest.mark.anyio
async def test_a_known_key_is_answered_whatever_the_budget(ledger: Ledger) -> None:
    await spend(ledger, "k1", 1000.0)
    again = await ledger.claim(spending("k1", 1000.0), T0 + 1)
    assert again.kind is ClaimKind.EXISTING


@pytest.mark.anyio
@pytest.mark.parametrize("state", [State.FAILED_RETRYABLE, State.COMPENSATED])
async def test_retryable_and_compensated_operations_give_their_amount_back(
    ledger: Ledger, state: State
) -> None:
    first = await ledger.get_by_id(None, await spend(ledger, "k1", 800.0))
    assert first is not None
    assert await refused(ledger, "k2") == 800.0
    to = State.SUCCEEDED if state is State.COMPENSATED else state
    done = await ledger.update(
        first.operation_id, finish(first, to, result=RESULT, error=ErrorRecord(message="no")), T0
    )
    assert done is not None
    if state is State.COMPENSATED:
        undo = finish(done, State.COMPENSATED)
        undo = dataclasses.replace(undo, expect_states=frozenset({State.SUCCEEDED}), expect_fence=None)
        assert await ledger.update(first.operation_id, undo, T0)
    await spend(ledger, "k2", 1000.0)


@pytest.mark.anyio
@pytest.mark.parametrize("state", [State.SUCCEEDED, State.UNKNOWN, State.FAILED_FINAL])
async def test_succeeded_unknown_and_final_failed_operations_keep_counting(
    ledger: Ledger, state: State
) -> None:
    first = await ledger.get_by_id(None, await spend(ledger, "k1", 800.0))
    assert first is not None
    assert await ledger.update(
        first.operation_id, finish(first, state, result=RESULT, error=ErrorRecord(message="?")), T0
    )
    assert await refused(ledger, "k2", now=T0 + 10) == 800.0


@pytest.mark.anyio
async def test_a_retryable_operation_taken_again_spends_again_only_if_it_fits(ledger: Ledger) -> None:
    first = await ledger.get_by_id(None, await spend(ledger, "k1", 600.0))
    assert first is not None
    assert await ledger.update(
        first.operation_id, finish(first, State.FAILED_RETRYABLE, error=ErrorRecord(message="busy")), T0
    )
    await spend(ledger, "k2", 600.0)  # the failed one no longer counts
    assert await refused(ledger, "k1", 600.0, now=T0 + 1) == 600.0  # running it again would pass the limit
    kept = await ledger.get("alice", "s1", "k1")
    assert kept is not None and kept.state is State.FAILED_RETRYABLE


@pytest.mark.anyio
async def test_spending_leaves_the_budget_with_the_window(ledger: Ledger) -> None:
    await spend(ledger, "k1", 1000.0)
    assert await refused(ledger, "k2", 1.0, now=T0 + 3599) == 1000.0
    await spend(ledger, "k2", 1000.0, now=T0 + 3600)


@pytest.mark.anyio
async def test_scopes_principal_session_and_all(ledger: Ledger) -> None:
    await spend(ledger, "k1", 1000.0)
    await spend(ledger, "k2", 1000.0, principal="bob")  # per principal: bob has his own
    per_session = dataclasses.replace(LIMIT, name="travel", per="session")
    await spend(ledger, "t1", 1000.0, check=per_session)
    await spend(ledger, "t2", 1000.0, check=per_session, session="s2")
    assert await refused(ledger, "t3", 1.0, check=per_session, session="s2") == 1000.0
    for_all = dataclasses.replace(LIMIT, name="shared", per="all")
    await spend(ledger, "a1", 600.0, check=for_all)
    assert await refused(ledger, "a2", 600.0, check=for_all, principal="carol", session="x") == 600.0
    spent = await ledger.budget_spent("travel", "session", T0 - 3600, T0)
    assert sorted((s.scope, s.spent, s.operations) for s in spent) == [
        ("alice/s1", 1000.0, 1),
        ("alice/s2", 1000.0, 1),
    ]
    payments = await ledger.budget_spent("payments", "principal", T0 - 3600, T0)
    assert sorted((s.principal, s.session, s.spent) for s in payments) == [
        ("alice", None, 1000.0),
        ("bob", None, 1000.0),
    ]
    (shared,) = await ledger.budget_spent("shared", "all", T0 - 3600, T0)
    assert (shared.scope, shared.spent) == ("all", 600.0)


@pytest.mark.anyio
async def test_concurrent_claims_never_jointly_overspend(ledger: Ledger) -> None:
    """Twelve claims of 300 against a limit of 1000 arrive together: exactly three are claimed."""
    claims = [ledger.claim(spending(f"k{i}", 300.0), T0) for i in range(12)]
    results = await asyncio.gather(*claims, return_exceptions=True)
    claimed = [r for r in results if not isinstance(r, BaseException)]
    assert len(claimed) == 3, results
    assert all(
        isinstance(r, OverBudget) and r.spent == 900.0 for r in results if isinstance(r, BaseException)
    )
    (spent,) = await ledger.budget_spent("payments", "principal", T0 - 3600, T0)
    assert (spent.spent, spent.operations) == (900.0, 3)


@pytest.mark.anyio
async def test_concurrent_copies_of_one_call_are_one_operation_not_a_budget_refusal(ledger: Ledger) -> None:
    """The whole limit under one key, sent eight times at once: one claim, seven answered from it."""
    claims = await asyncio.gather(*(ledger.claim(spending("k1", 1000.0), T0) for _ in range(8)))
    assert sorted(c.kind.value for c in claims) == ["existing"] * 7 + ["new"]


@pytest.mark.anyio
async def test_concurrent_claims_of_other_scopes_and_other_budgets_all_go_through(ledger: Ledger) -> None:
    claims = [ledger.claim(spending(f"k{i}", 1000.0, principal=f"p{i}"), T0) for i in range(8)]
    claims += [ledger.claim(request(f"plain{i}", fingerprint=f"fp-plain-{i}"), T0) for i in range(8)]
    results = await asyncio.gather(*claims)
    assert {r.kind for r in results} == {ClaimKind.NEW}


@pytest.mark.anyio
async def test_a_repeat_of_an_action_that_spent_is_a_duplicate_not_a_budget_refusal(ledger: Ledger) -> None:
    checked = DuplicateCheck(window_seconds=600.0, any_session=False, reject=True)
    first = dataclasses.replace(spending("k1", 1000.0), fingerprint="fp-same", duplicates=checked)
    await ledger.claim(first, T0)
    again = await ledger.claim(dataclasses.replace(first, step="k2"), T0 + 1)  # a fresh key, the budget full
    assert again.kind is ClaimKind.DUPLICATE and again.operation.step == "k1"
    assert await ledger.get("alice", "s1", "k2") is None


@pytest.mark.anyio
async def test_amounts_add_up_exactly(ledger: Ledger) -> None:
    tenths = dataclasses.replace(LIMIT, limit=exact(0.3))
    for step in ("d1", "d2", "d3"):  # in binary floats the third would pass 0.3
        await spend(ledger, step, 0.1, check=tenths)
    assert await refused(ledger, "d4", 0.000000001, check=tenths) == Decimal("0.3")
    (spent,) = await ledger.budget_spent("payments", "principal", T0 - 3600, T0)
    assert spent.spent == Decimal("0.3") and isinstance(spent.spent, Decimal)


@pytest.mark.anyio
async def test_the_sqlite_sum_reads_only_its_index(tmp_path: Path) -> None:
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    await spend(ledger, "k1")
    await ledger.close()
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        for per, scope in (("all", ()), ("principal", ("alice",)), ("session", ("alice", "s1"))):
            sql = BUDGET_SUMS[per]
            plan = " ".join(
                row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, ("payments", *scope, 0, 0))
            )
            assert "USING COVERING INDEX operations_budget" in plan, plan
        total = conn.execute(BUDGET_SUMS["principal"], ("payments", "alice", 0, 0)).fetchone()
        assert total == (400, 0)  # whole units, billionths


@pytest.mark.anyio
@pytest.mark.postgres
async def test_the_postgres_sum_uses_its_index() -> None:
    from support.postgres import plan_on_fresh_ledger

    plan = await plan_on_fresh_ledger(
        "SELECT coalesce(sum(o.budget_amount), 0) FROM commitgate_operations o"
        " WHERE o.budget = 'payments' AND o.principal = 'alice' AND o.budget_spent_at > 0"
        " AND o.state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'UNKNOWN')"
        " AND (o.expires_at IS NULL OR o.expires_at > 0)"
    )
    assert "commitgate_operations_budget" in plan, plan


@pytest.mark.anyio
async def test_a_ledger_of_the_previous_schema_is_migrated_and_its_spending_keeps_counting(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SQLiteLedger.open(path)
    await spend(ledger, "old", 700.5)
    await ledger.close()
    with sqlite3.connect(path) as conn:  # back to version 6: amounts in REAL, placed by created_at
        sqlite_back_to_version_7(conn)
        conn.execute("DROP INDEX operations_budget")
        conn.execute("ALTER TABLE operations ADD COLUMN budget_amount REAL")
        conn.execute("UPDATE operations SET budget_amount = budget_units + budget_nanos / 1e9")
        for column in ("budget_spent_at", "budget_units", "budget_nanos"):
            conn.execute(f"ALTER TABLE operations DROP COLUMN {column}")
        conn.execute(
            "CREATE INDEX operations_budget ON operations (budget, principal, session, created_at, state,"
            " budget_amount, expires_at) WHERE budget IS NOT NULL"
        )
        conn.execute("DELETE FROM schema_version WHERE version > 6")
    ledger = await SQLiteLedger.open(path)
    try:
        assert await refused(ledger, "k1", 300.0, now=T0 + 1) == Decimal("700.5")
        await spend(ledger, "k2", 299.5, now=T0 + 1)
    finally:
        await ledger.close()


# --- the boundary: the amount, the answer, nothing run -------------------------------------------


def budgeted(
    record: SystemOfRecord, limit: float = 1000.0, amount: str = "arguments.amount", **kw: object
) -> tuple[GuardedTool, ScriptedTool]:
    source = ScriptedTool(record)
    tool = guarded("charge", "key-required", source)
    policy = BudgetPolicy.model_validate({"amount": amount, "limit": limit, "window": "1h", **kw})
    return dataclasses.replace(tool, budget=Budget("payments", policy)), source


def call(tool: GuardedTool, key: str, arguments: dict[str, object], principal: str = "alice") -> CallRequest:
    return CallRequest(tool, arguments, key, "s1", principal)


@pytest.mark.anyio
async def test_a_call_over_budget_answers_budget_exceeded_and_runs_nothing(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    tool, source = budgeted(record)
    boundary = make_boundary(ledger, [tool])
    assert (await boundary.call(call(tool, "k1", {"amount": 700}))).error is None
    answer = await boundary.call(call(tool, "k2", {"amount": 400}))
    assert answer.error is not None and answer.error.code is ErrorCode.BUDGET_EXCEEDED
    assert answer.operation is None
    assert answer.error.details == {
        "budget": {"name": "payments", "limit": 1000, "spent": 700, "window": "1h"}
    }
    message = answer.error.message
    assert "nothing was executed or recorded" in message
    assert (
        "would spend 400 from budget 'payments', which allows 1000 for principal 'alice' within any 1h"
        in message
    )
    assert "700 is already spent in that window, so 300 is left" in message
    assert "Do not split the action into smaller calls" in message
    assert record.count() == 1 and source.calls == 1
    assert await ledger.get("alice", "s1", "k2") is None
    # another principal has a budget of its own
    assert (await boundary.call(call(tool, "k2", {"amount": 400}, principal="bob"))).error is None
    assert record.count() == 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("arguments", "amount", "says"),
    [
        (
            {"amount": "500"},
            "arguments.amount",
            "needs a number for what this call spends, but 'arguments.amount' gave '500' (str)",
        ),
        ({"amount": True}, "arguments.amount", "gave True (bool)"),
        ({"other": 5}, "arguments.amount", "could not work out what this call spends"),
        ({"amount": -5}, "arguments.amount", "must be a finite number >= 0, got -5"),
        ({"amount": 5}, "double(arguments.amount) / 0.0", "must be a finite number >= 0, got inf"),
    ],
)
async def test_an_amount_that_is_not_a_number_refuses_the_call_and_records_nothing(
    ledger: Ledger, record: SystemOfRecord, arguments: dict[str, object], amount: str, says: str
) -> None:
    tool, source = budgeted(record, amount=amount)
    boundary = make_boundary(ledger, [tool])
    answer = await boundary.call(call(tool, "k1", arguments))
    assert answer.error is not None and answer.error.code is ErrorCode.INVALID_ARGUMENTS
    assert says in answer.error.message, answer.error.message
    assert "budget 'payments'" in answer.error.message
    assert source.calls == 0 and record.count() == 0
    assert await ledger.get("alice", "s1", "k1") is None


@pytest.mark.anyio
async def test_a_call_that_ran_and_failed_keeps_its_amount_spent(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    """Only what certainly did not run gives its amount back: a permanent failure came after the tool ran."""
    tool, source = budgeted(record)
    source.script = ["permanent"]
    boundary = make_boundary(ledger, [tool])
    failed = await boundary.call(call(tool, "k1", {"amount": 1000}))
    assert failed.error is not None and failed.error.code is ErrorCode.OPERATION_FAILED
    refused = await boundary.call(call(tool, "k2", {"amount": 1000}))
    assert refused.error is not None and refused.error.code is ErrorCode.BUDGET_EXCEEDED
    assert (record.count(), source.calls) == (0, 1)


@pytest.mark.anyio
async def test_a_retryable_failure_run_again_is_checked_against_the_budget(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    tool, source = budgeted(record)
    source.script = ["retryable"] * 3  # every attempt of the first call: FAILED_RETRYABLE
    clock = FakeClock(T0)
    boundary = make_boundary(ledger, [tool], clock=clock)
    first = await boundary.call(call(tool, "k1", {"amount": 600}))
    assert first.error is not None and first.error.code is ErrorCode.RETRIES_EXHAUSTED
    assert (await boundary.call(call(tool, "k2", {"amount": 600}))).error is None
    again = await boundary.call(call(tool, "k1", {"amount": 600}))  # would run it again: 1200 > 1000
    assert again.error is not None and again.error.code is ErrorCode.BUDGET_EXCEEDED
    assert record.count() == 1


@pytest.mark.anyio
async def test_records_of_a_budgeted_tool_are_kept_for_the_whole_window(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    tool, _ = budgeted(record, window="30d")
    boundary = make_boundary(ledger, [tool], retention="1h")
    answer = await boundary.call(call(tool, "k1", {"amount": 10}))
    assert answer.operation is not None and answer.operation.retention == 30 * 86400.0


# --- metrics: limits, and spent per principal ---------------------------------------------------------


@pytest.mark.anyio
async def test_metrics_export_limits_and_what_each_principal_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from commitgate.server.serve.gateway import Gateway
    from commitgate.server.serve.metrics import Metrics

    monkeypatch.setenv("COMMITGATE_SANDBOX", str(tmp_path / "sandbox.db"))
    policy = loads_policy(POLICY.replace('window = "30d"', 'window = "1s"'))
    policy.ledger.url = f"sqlite:///{tmp_path / 'ledger.db'}"
    gateway = await Gateway.open(policy, None)
    metrics = Metrics()
    metrics.attach(gateway)

    async def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = (await metrics.exposition(gateway.ledger, gateway.policy.budgets)).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("commitgate_budget")
        }

    def charge(key: str, cents: int) -> dict[str, object]:
        return {"card": "4242", "amount_cents": cents, "description": key, "idempotency_key": key}

    try:
        assert await scrape() == {("commitgate_budget_limit", (("budget", "payments"),)): 100000.0}
        for principal, cents in (("alice", 60000), ("bob", 30000)):
            assert not (
                await gateway.call_tool("charge_card", charge(principal, cents), {}, principal)
            ).is_error
        assert (await gateway.call_tool("charge_card", charge("a2", 50000), {}, "alice")).is_error
        scraped = await scrape()
        assert scraped[("commitgate_budget_spent", (("budget", "payments"), ("principal", "alice")))] == 60000
        assert scraped[("commitgate_budget_spent", (("budget", "payments"), ("principal", "bob")))] == 30000
        assert (
            scraped[
                (
                    "commitgate_budget_claims_total",
                    (("idempotency_class", "key-and-status-check"), ("tool", "charge_card")),
                )
            ]
            == 2
        )
        assert (
            scraped[
                (
                    "commitgate_budget_exceeded_total",
                    (("idempotency_class", "key-and-status-check"), ("tool", "charge_card")),
                )
            ]
            == 1
        )
        await asyncio.sleep(1.1)  # the spending leaves the window: its series go away
        assert not any(name == "commitgate_budget_spent" for name, _ in await scrape())
    finally:
        await gateway.close()


def test_ops_budgets_says_when_the_policy_declares_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from support.policy import run

    path = tmp_path / "policy.toml"
    path.write_text('[server]\nname = "no-budgets"\n', encoding="utf-8")
    done = run(capsys, ["ops", "budgets", "--policy", str(path)])
    assert done.code == 1
    assert "the policy declares no budgets ([budgets.NAME]); nothing to show" in done.err


@pytest.mark.anyio
async def test_the_budget_benchmark_runs_and_reports_its_figures(tmp_path: Path) -> None:
    from commitgate.server.bench.budgets import measure

    figures = await measure(prior=20, calls=10, rounds=2, root=tmp_path)
    assert figures["prior_operations_in_scope"] == 20 and len(figures["added_per_round_us"]) == 2
    assert figures["plain_median_us"] > 0 and figures["budgeted_median_us"] > 0


# --- what a refusal leaves in traces and logs ---------------------------------------------------------


@pytest.mark.anyio
async def test_a_refusal_is_an_answer_in_the_claim_span_and_logs_keep_the_amount_out(
    tmp_path: Path, record: SystemOfRecord
) -> None:
    import io
    import json

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import commitgate.server.core.tracing as tracing
    from commitgate.server.model import traces
    from commitgate.server.serve.logs import configure_logging, log_event

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    logged = io.StringIO()
    configure_logging("info", stream=logged)
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    traces.turn_on(provider)
    try:
        tool, _ = budgeted(record)
        boundary = make_boundary(ledger, [tool])
        boundary.observers.extend([*tracing.span_events(), log_event])
        assert (await boundary.call(call(tool, "k1", {"amount": 987}))).error is None
        refused = await boundary.call(call(tool, "k2", {"amount": 654}))
        assert refused.error is not None and refused.error.code is ErrorCode.BUDGET_EXCEEDED
    finally:
        traces.turn_off()
        provider.shutdown()
        await ledger.close()
        configure_logging("warning")
    claims = [dict(s.attributes or {}) for s in exporter.get_finished_spans() if s.name == "commitgate.claim"]
    assert [c.get("commitgate.claim") for c in claims] == ["new", "over_budget"]
    spans = exporter.get_finished_spans()
    assert all(s.status.status_code.name != "ERROR" for s in spans if s.name == "commitgate.claim")
    events = [json.loads(line) for line in logged.getvalue().splitlines()]
    budget_events = [e for e in events if e.get("event") in ("budget_spent", "budget_exceeded")]
    assert [e["event"] for e in budget_events] == ["budget_spent", "budget_exceeded"]
    assert all(e["budget"] == "payments" for e in budget_events)
    # Amounts come from arguments: neither is a value or a word of any line (a random operation id
    # may hold the same digits among its hex ones).
    assert not re.search(r"\b(987|654)\b", logged.getvalue()), logged.getvalue()


@pytest.mark.anyio
async def test_a_reloaded_policy_applies_its_new_limit_to_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from commitgate.server.demo import tools as demo
    from commitgate.server.policy.loading import load_policy
    from commitgate.server.serve.gateway import Gateway
    from commitgate.server.serve.reload import PolicyReloader, ReloadStatus

    monkeypatch.setenv("COMMITGATE_SANDBOX", str(tmp_path / "sandbox.db"))
    path = tmp_path / "policy.toml"
    ledger = f'\n[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
    path.write_text(POLICY.replace("limit = 100000", "limit = 1000") + ledger, encoding="utf-8")
    gateway = await Gateway.open(load_policy(path), path)

    async def on_applied() -> None:
        return None

    reloader = PolicyReloader(gateway, path, on_applied, quiet=0.0)
    await reloader.prime()

    def charge(key: str) -> dict[str, object]:
        return {"card": "4242", "amount_cents": 800, "description": key, "idempotency_key": key}

    try:
        assert not (await gateway.call_tool("charge_card", charge("k1"), None, "alice")).is_error
        refused = await gateway.call_tool("charge_card", charge("k2"), None, "alice")
        assert refused.structured_content is not None
        assert refused.structured_content["error"]["budget"]["limit"] == 1000
        path.write_text(POLICY.replace("limit = 100000", "limit = 2000") + ledger, encoding="utf-8")
        assert (
            await reloader.reload()
        ).status is ReloadStatus.WAITING  # a raised limit waits for a quiet file
        assert (await reloader.reload()).status is ReloadStatus.APPLIED
        assert not (await gateway.call_tool("charge_card", charge("k2"), None, "alice")).is_error
    finally:
        await gateway.close()
    assert demo.count("charges") == 2


@pytest.mark.anyio
async def test_a_sqlite_group_commit_counts_the_claims_before_each_one(tmp_path: Path) -> None:
    """Claims committed together (run_many) fit only if each fits after the ones before it in the batch."""
    from commitgate.server.ledger.sqlite._writes import ClaimWrite

    path = tmp_path / "ledger.db"
    await (await SQLiteLedger.open(path)).close()
    conn = sqlite3.connect(path, isolation_level=None)
    try:

        def batch(*requests: ClaimRequest) -> object:
            conn.execute("BEGIN IMMEDIATE")
            try:
                return ClaimWrite.run_many(conn, [ClaimWrite(r, T0) for r in requests])
            finally:
                conn.execute("ROLLBACK")

        fits = batch(spending("k1"), spending("k2"), spending("k3", 200.0), request("plain", fingerprint="x"))
        assert isinstance(fits, list) and len(fits) == 4
        assert batch(spending("k1"), spending("k2"), spending("k3")) is None  # 1200 > 1000: one by one
        other_shape = dataclasses.replace(LIMIT, per="all")
        assert batch(spending("k1", 1.0), spending("k2", 1.0, check=other_shape)) is None
        assert (
            batch(spending("k1"), spending("k2", principal="bob"), spending("k3", principal="carol"))
            is not None
        )
    finally:
        conn.close()
