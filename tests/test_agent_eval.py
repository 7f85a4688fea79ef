"""Agent evals with the pytest plugin: a scripted agent against a real server, effects counted.

The `gate` fixture comes from the `commitgate` pytest plugin (loaded by its entry point): a real
`commitgate serve` process over the bundled demo policy, its own ledger, faults at the boundary.
Every count is checked twice: in the ledger (`gate.assert_effects`) and in the system of record.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest
from mcp import Client, MCPError
from mcp.types import CallToolResult, RequestParamsMeta

from commitgate.server.demo import tools as demo
from commitgate.server.verify.harness import Gate

pytestmark = pytest.mark.anyio
SESSION_META = "commitgate/session"
CARD = "4242424242424242"


@pytest.fixture
def commitgate_env(sandbox: Path) -> dict[str, str]:
    """The server's demo tools write to this test's sandbox (the system of record)."""
    return {demo.ENV_PATH: str(sandbox)}


async def call(client: Client, session: str, tool: str, arguments: dict[str, Any]) -> CallToolResult:
    return await client.call_tool(tool, arguments, meta=cast(RequestParamsMeta, {SESSION_META: session}))


async def careful_agent(client: Client, session: str, order: str) -> dict[str, Any]:
    """Charges an order, then refunds half of it; a lost answer is retried under the same key."""

    async def step(tool: str, arguments: dict[str, Any], key: str) -> dict[str, Any]:
        for _ in range(3):
            try:
                answer = await call(client, session, tool, {**arguments, "idempotency_key": key})
            except MCPError:  # the answer was lost: same action, same key
                continue
            assert not answer.is_error, answer.content
            return dict(answer.structured_content or {})
        raise AssertionError(f"{tool} never answered")

    charge = await step("charge_card", {"card": CARD, "amount_cents": 1000}, f"charge-{order}")
    refund = await step("refund", {"charge_id": charge["charge_id"], "amount_cents": 500}, f"refund-{order}")
    return {"charge": charge, "refund": refund}


async def hasty_agent(
    client: Client, session: str, charge_id: str, *, insist: bool = False
) -> CallToolResult:
    """Refunds, and on a lost answer refunds again under a new key: the bug evals must catch.

    commitgate refuses that re-issue as `possible_duplicate`; an agent that `insist`s confirms it."""
    answer = None
    for attempt in range(2):
        try:
            arguments: dict[str, Any] = {"charge_id": charge_id, "amount_cents": 100}
            arguments["idempotency_key"] = f"refund-{attempt}"
            if insist and attempt:
                arguments["confirm_duplicate"] = True
            answer = await call(client, session, "refund", arguments)
            return answer
        except MCPError:
            continue
    raise AssertionError("refund never answered")


async def test_lost_answers_leave_exactly_one_charge_and_one_refund(gate: Gate) -> None:
    await gate.lose_next_answer("charge_card")
    await gate.lose_next_answer("refund")
    done = await careful_agent(gate.client, "run-7", "order-1")
    await gate.assert_effects("charge_card", exactly=1, session="run-7")
    await gate.assert_effects("refund", exactly=1, session="run-7")
    assert demo.count("charges", session="run-7") == 1
    assert demo.count("refunds", session="run-7", charge_id=done["charge"]["charge_id"]) == 1
    assert await gate.invocations("refund") == 1


async def test_a_failure_before_the_call_still_ends_in_one_refund(gate: Gate) -> None:
    await gate.fail_next_before("refund", times=2)
    await careful_agent(gate.client, "run-8", "order-2")
    await gate.assert_effects("refund", exactly=1, session="run-8")
    assert demo.count("refunds", session="run-8") == 1
    (refund,) = await gate.operations("refund", session="run-8")
    assert refund["attempts"] == 3 and refund["state"] == "SUCCEEDED"


async def test_assert_effects_catches_an_agent_that_refunds_twice(gate: Gate) -> None:
    charge = await call(
        gate.client, "run-9", "charge_card", {"card": CARD, "amount_cents": 1000, "idempotency_key": "c"}
    )
    await gate.lose_next_answer("refund")
    assert charge.structured_content is not None
    await hasty_agent(gate.client, "run-9", charge.structured_content["charge_id"], insist=True)
    assert demo.count("refunds", session="run-9") == 2
    with pytest.raises(
        AssertionError, match=r"expected exactly 1 .* refund in session 'run-9', the ledger holds 2"
    ):
        await gate.assert_effects("refund", exactly=1, session="run-9")


async def test_a_re_issue_under_a_new_key_is_refused_as_a_possible_duplicate(gate: Gate) -> None:
    charge = await call(
        gate.client, "run-10", "charge_card", {"card": CARD, "amount_cents": 1000, "idempotency_key": "c"}
    )
    await gate.lose_next_answer("refund")
    assert charge.structured_content is not None
    answer = await hasty_agent(gate.client, "run-10", charge.structured_content["charge_id"])
    assert answer.is_error and answer.structured_content is not None
    assert answer.structured_content["error"]["code"] == "possible_duplicate"
    await gate.assert_effects("refund", exactly=1, session="run-10")
    assert demo.count("refunds", session="run-10") == 1


def test_the_plugin_loads_by_its_entry_point_in_a_users_suite(tmp_path: Path, sandbox: Path) -> None:
    """A user's suite, run by pytest in its own process, gets `gate` with no import and no conftest."""
    (tmp_path / "pytest.ini").write_text("[pytest]\ncommitgate_policy = policy.toml\n")
    (tmp_path / "policy.toml").write_text(
        '[tools.send_email]\nclass = "key-required"\npython = "commitgate.server.demo.tools:send_email"\n'
    )
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            import pytest

            EMAIL = {"to": "a@example.com", "subject": "hi", "body": "b"}

            @pytest.mark.anyio
            async def test_once(gate):
                await gate.client.call_tool("send_email", {**EMAIL, "idempotency_key": "k1"})
                await gate.client.call_tool("send_email", {**EMAIL, "idempotency_key": "k1"})
                await gate.assert_effects("send_email", exactly=1)

            @pytest.mark.anyio
            async def test_twice(gate):
                for key in ("k1", "k2"):  # two emails: the same one under a new key would be refused
                    await gate.client.call_tool("send_email", {**EMAIL, "body": key, "idempotency_key": key})
                await gate.assert_effects("send_email", exactly=1)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": ""}
    quiet = ["-q", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin"]  # as in pyproject.toml
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *quiet, "test_user.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    assert "expected exactly 1 succeeded execution(s) of send_email, the ledger holds 2" in done.stdout
    assert demo.count("emails") == 3  # k1 once (replayed once), k1 and k2 in the second test
