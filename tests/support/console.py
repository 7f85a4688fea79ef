"""The console under test: a ledger with operations in it, and a signed-in HTTP client of the app.

Operations come from real calls through a gateway (an `UNKNOWN` from a lost acknowledgement in the
demo sandbox) or, for what no tool would send (markup in a session, a principal), from direct
claims on the ledger file.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

from mcp.types import CallToolResult
from starlette.testclient import TestClient

from commitgate.server.console.app import create_app, ledger_opener
from commitgate.server.console.security import CSRF_FIELD, Access
from commitgate.server.core import approvals
from commitgate.server.ledger import open_ledger
from commitgate.server.ledger.base import BudgetCheck, ClaimRequest, Ledger, Transition
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.amounts import amount as exact
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ApprovalRecord, ErrorRecord
from commitgate.server.policy.approvals import ApprovalPolicy
from commitgate.server.policy.loading import load_policy
from commitgate.server.policy.tokens import TokenTable
from commitgate.server.serve.gateway import Gateway
from support.ledgers import OUTCOME_EVENTS

BASE_URL = "http://127.0.0.1:8766"
EMAIL = {"to": "ann@example.com", "subject": "Your receipt", "body": "Thanks"}
POLICY = """
[server]
principal = "agent"

[ledger]
url = "sqlite:///{ledger}"

[tools.send_email]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
retry = {{ attempts = 1 }}
duplicates = false  # the tests send the same email under several keys on purpose

[tools.mail_out]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
duplicates = false
approval = {{ when = "!arguments.to.endsWith('@example.com')", prompt = "Send '{{arguments.subject}}' to {{arguments.to}}?" }}

[tools.ask_the_user]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
duplicates = false
approval = {{ via = ["client"] }}

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
retry = {{ attempts = 1 }}

[tools.reserve]
class = "compensable"
python = "commitgate.server.demo.tools:reserve"
compensate = {{ tool = "release", arguments = {{ booking_id = "{{result.booking_id}}" }} }}

[tools.release]
class = "key-required"
python = "commitgate.server.demo.tools:release"
expose = false
"""


# Three budgets, one of each `per`, for the Budgets page; limits far above what the tests spend.
BUDGETS = """
[budgets.payments]
amount = "arguments.amount_cents"
limit = 1000000
window = "30d"
per = "principal"

[budgets.travel]
amount = "arguments.amount_cents"
limit = 50000
window = "24h"
per = "session"
exceeded = "approval"

[budgets.shared]
amount = "arguments.amount_cents"
limit = 20000
window = "1h"
per = "all"

[tools.pay]
class = "key-required"
python = "commitgate.server.demo.tools:charge_card"
budget = "payments"
"""
WINDOWS = {"payments": 30 * 86400.0, "travel": 86400.0, "shared": 3600.0}
PER = {"payments": "principal", "travel": "session", "shared": "all"}


def write_policy(root: Path, extra: str = "") -> Path:
    path = root / "policy.toml"
    path.write_text(POLICY.format(ledger=root / "ledger.db") + extra, encoding="utf-8")
    return path


async def _seeding(where: Path | str) -> Ledger:
    """A ledger to fill with fixtures: a SQLite file without a sync per commit (thousands of
    commits that no crash will test; the pages' figures do not depend on it)."""
    return (
        await SQLiteLedger.open(where, synchronous="OFF")
        if isinstance(where, Path)
        else await open_ledger(where)
    )


async def in_groups(writes: Sequence[Callable[[], Awaitable[None]]], size: int) -> None:
    """Runs `writes`, `size` of them at a time: concurrent claims reach the SQLite ledger's writer
    together and are committed in groups, as a busy server's are, rather than one transaction each."""
    for start in range(0, len(writes), size):
        await asyncio.gather(*(write() for write in writes[start : start + size]))


async def spend(
    where: Path | str,
    budget: str,
    spends: Sequence[tuple[str, str, float, float]],
    state: State = State.SUCCEEDED,
    *,
    together: int = 1,
) -> None:
    """Budgeted operations of `budget` (of BUDGETS) written straight into the ledger, each
    (principal, session, amount, created_at), claimed through the budget check and left in `state`;
    `together` of them at a time (their budget's limit is far above what they add up to)."""
    ledger = await _seeding(where)

    async def one(i: int, principal: str, session: str, amount: float, at: float) -> None:
        step = f"{budget}-{state.value.lower()}-{i}-{at}"
        request = ClaimRequest(
            principal=principal,
            session=session,
            step=step,
            tool="pay",
            idempotency_class=IdempotencyClass.KEY_REQUIRED,
            fingerprint=f"fp-{step}",
            arguments_json=json.dumps({"amount_cents": amount}),
            owner="elsewhere:1:aaaa",
            lease_seconds=60.0,
            retention_seconds=WINDOWS[budget],
            budget=BudgetCheck(budget, PER[budget], exact(amount), Decimal(10**12), WINDOWS[budget]),
        )
        op = (await ledger.claim(request, at)).operation
        if state is not State.RUNNING:
            change = Transition(
                state, frozenset({State.RUNNING}), OUTCOME_EVENTS[state], expect_fence=op.fence
            )
            assert await ledger.update(op.operation_id, change, at) is not None

    try:
        await in_groups([functools.partial(one, i, *each) for i, each in enumerate(spends)], together)
    finally:
        await ledger.close()


async def call(policy: Path, tool: str, key: str, session: str = "s1", **arguments: Any) -> CallToolResult:
    """One call through a gateway opened for it (the way a server process would make it)."""
    gw = await Gateway.open(load_policy(policy), policy)
    try:
        meta = {"commitgate/session": session}
        return await gw.call_tool(tool, {**arguments, "idempotency_key": key}, meta, None)
    finally:
        await gw.close()


def error_code(result: CallToolResult) -> str | None:
    return (result.structured_content or {}).get("error", {}).get("code") if result.is_error else None


async def claim(
    where: Path | str,
    *,
    principal: str = "agent",
    session: str = "s1",
    step: str = "k1",
    tool: str = "charge_card",
    arguments: dict[str, Any] | None = None,
    state: State = State.UNKNOWN,
    owner: str = "elsewhere:1:aaaa",
    at: float | None = None,
    timeout: float = 3600.0,
) -> str:
    """An operation written straight into the ledger (a SQLite file or a URL; any strings at all); its id.

    AWAITING_APPROVAL: recorded as a call that needs approval is, waiting `timeout` seconds."""
    ledger = await _seeding(where)
    now = time.time() if at is None else at
    try:
        request = ClaimRequest(
            principal=principal,
            session=session,
            step=step,
            tool=tool,
            idempotency_class=IdempotencyClass.KEY_REQUIRED,
            fingerprint=f"fp-{principal}-{session}-{step}",
            arguments_json=json.dumps(arguments or {}),
            owner=owner,
            lease_seconds=60.0,
            retention_seconds=86400.0,
            approval=waits(now, timeout) if state is State.AWAITING_APPROVAL else None,
        )
        op = (await ledger.claim(request, now)).operation
        if state not in (State.RUNNING, State.AWAITING_APPROVAL):
            error = (
                ErrorRecord(code="ambiguous", message="the answer was lost")
                if state is State.UNKNOWN
                else None
            )
            change = Transition(
                state, frozenset({State.RUNNING}), AuditEvent.AMBIGUOUS, expect_fence=op.fence, error=error
            )
            assert await ledger.update(op.operation_id, change, now) is not None
        return op.operation_id
    finally:
        await ledger.close()


def waits(now: float, timeout: float = 3600.0) -> ApprovalRecord:
    """The approval record of a call waiting for a person (the policy's defaults, `timeout` apart)."""
    return approvals.record(ApprovalPolicy(timeout=timeout), now)


SEEDED_TOGETHER = 500  # thousands of operations for timing pages, written 500 at a time


async def seed(ledger_path: Path, count: int, unknown_every: int = 5, awaiting_every: int = 0) -> None:
    """`count` operations in one go (for timing pages): every `unknown_every`-th one UNKNOWN, and
    every `awaiting_every`-th of the others (when set) AWAITING_APPROVAL."""
    ledger = await _seeding(ledger_path)
    now = time.time()

    async def one(i: int) -> None:
        request = ClaimRequest(
            principal="agent",
            session=f"run-{i % 50}",
            step=f"step-{i}",
            tool=("charge_card", "send_email", "refund")[i % 3],
            idempotency_class=IdempotencyClass.KEY_REQUIRED,
            fingerprint=f"fp-{i}",
            arguments_json=json.dumps({"amount_cents": i, "card": "4242424242424242"}),
            owner="elsewhere:1:aaaa",
            lease_seconds=60.0,
            retention_seconds=86400.0,
            approval=waits(now) if awaiting_every and i % unknown_every and i % awaiting_every == 1 else None,
        )
        op = (await ledger.claim(request, now + i * 1e-3)).operation
        if op.state is State.AWAITING_APPROVAL:
            return
        state = State.UNKNOWN if i % unknown_every == 0 else State.SUCCEEDED
        change = Transition(state, frozenset({State.RUNNING}), OUTCOME_EVENTS[state], expect_fence=op.fence)
        await ledger.update(op.operation_id, change, now + i * 1e-3)

    try:
        await in_groups([functools.partial(one, i) for i in range(count)], SEEDED_TOGETHER)
    finally:
        await ledger.close()


def loopback_access(operator: str = "alice") -> Access:
    return Access.for_bind("127.0.0.1", 8766, TokenTable(), operator)


@contextlib.contextmanager
def console_client(
    ledger_url: str, access: Access, *, sign_in: bool = True, policy: Path | None = None
) -> Iterator[TestClient]:
    """A client of the console app (its lifespan opens the ledger), signed in with the console's token;
    `policy` gives the tools' approval prompts, as `commitgate console --policy` does."""
    app = create_app(ledger_opener(ledger_url), access, policy=load_policy(policy) if policy else None)
    with TestClient(app, base_url=BASE_URL, follow_redirects=False) as client:
        if sign_in:
            assert access.console_token is not None
            answer = client.get(f"/?token={access.console_token}")
            assert answer.status_code == 303, answer.text
        yield client


def csrf_of(html: str) -> str:
    found = re.search(rf'name="{CSRF_FIELD}" value="([^"]+)"', html)
    assert found is not None, "no CSRF token in the page"
    return found.group(1)


HOUR, DAY = 3600.0, 86400.0
MARKUP_SESSION = "s<script>alert('xss')</script>"


async def spend_in_every_budget(where: Path | str, at: float) -> None:
    """Spending in each of the three budgets of BUDGETS, some of it outside the window, failed
    (given back) or UNKNOWN (counted); one session's name is markup."""
    payments = [
        ("alice", "s1", 1200, at - 10 * DAY),
        ("alice", "s2", 300, at - HOUR),
        ("bob", "s1", 2500, at - 2 * DAY),
        ("bob", "s1", 40.5, at - 4 * DAY),
        ("alice", "s1", 999, at - 40 * DAY),  # out of the window
    ]
    await spend(where, "payments", payments)
    # certainly not applied: gives its amount back (a FAILED_FINAL that ran would keep it)
    await spend(where, "payments", [("alice", "s1", 5000, at - DAY)], State.FAILED_RETRYABLE)
    await spend(where, "payments", [("bob", "s3", 70, at - 3 * HOUR)], State.UNKNOWN)
    travel = [
        ("alice", "s1", 700, at - 3 * HOUR),
        ("alice", MARKUP_SESSION, 450, at - 1800),
        ("bob", "s2", 100, at - 20 * HOUR),
    ]
    await spend(where, "travel", travel)
    await spend(where, "shared", [("alice", "s1", 1000, at - 3000), ("bob", "s1", 3000, at - 600)])


async def seed_budgets(ledger_path: Path, count: int) -> None:
    """`count` budgeted operations spread over the three budgets of BUDGETS and over their windows:
    8 principals, 100 sessions (for timing the Budgets page)."""
    at = time.time()
    for name, window in WINDOWS.items():
        share = count // len(WINDOWS)
        spends = [
            (f"agent-{i % 8}", f"run-{i % 100}", float(1 + i % 97), at - window * (i + 0.5) / share)
            for i in range(share)
        ]
        await spend(ledger_path, name, spends, together=SEEDED_TOGETHER)
