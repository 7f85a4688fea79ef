"""Who acted: the principal for its call, `commitgate` for what it does on its own, an operator for a decision.

A real `commitgate serve` sends an email whose first attempt fails before any effect (an injected
fault of the demo sandbox); commitgate retries on its own and the second attempt sends it (one email in
the sandbox). `commitgate ops show` and the console's operation page name the principal for the claim
and `commitgate` for the retry and the outcome it produced; an operator's resolution names the operator.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import pytest
from support.console import claim, console_client, loopback_access
from support.e2e import CONSOLE_SCRIPT, Deployment, serve

PRINCIPAL = "agent-7"
EMAIL = {"to": "ann@example.com", "subject": "Receipt", "body": "Thanks"}


def ops(deployment: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    where = ["--policy", str(deployment.policy), "--ledger", f"sqlite:///{deployment.ledger}"]
    return subprocess.run(
        [str(CONSOLE_SCRIPT), "ops", *args, *where],
        env=deployment.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def history(deployment: Deployment, op_id: str) -> list[tuple[str, str, str]]:
    shown = ops(deployment, "show", op_id, "--json")
    assert shown.returncode == 0, shown.stderr
    return [(e["event"], e["actor"], e["actor_role"]) for e in json.loads(shown.stdout)["history"]]


@pytest.mark.anyio
async def test_an_automatic_retry_and_a_status_check_are_commitgates(tmp_path: Path) -> None:
    deployment = Deployment.create(tmp_path, principal=PRINCIPAL)
    async with serve(deployment, faults="send_email.fail_before=1x,charge_card.lose_ack=1x") as server:
        sent = await server.client.call_tool("send_email", {**EMAIL, "idempotency_key": "mail-1"})
        assert not sent.is_error, sent
        lost = await server.client.call_tool(
            "charge_card", {"card": "4242", "amount_cents": 100, "idempotency_key": "charge-1"}
        )
    assert deployment.count("emails") == 1  # the retry sent it, once
    op_id = str(sent.meta["commitgate/operation"]["operation_id"])  # type: ignore[index]
    assert history(deployment, op_id) == [
        ("claimed", PRINCIPAL, "principal"),
        ("retry", "commitgate", "commitgate"),
        ("succeeded", "commitgate", "commitgate"),
    ]
    # the charge's answer was lost: its status check (commitgate's) found it; or an operator says
    charge_id = str(lost.meta["commitgate/operation"]["operation_id"]) if lost.meta else None
    assert charge_id is not None
    actors = {event: (actor, role) for event, actor, role in history(deployment, charge_id)}
    assert actors["claimed"] == (PRINCIPAL, "principal")
    assert actors["reconciled_found"] == ("commitgate", "commitgate")

    with console_client(f"sqlite:///{deployment.ledger}", loopback_access()) as client:
        page = client.get(f"/operations/{op_id}").text
    rows = re.findall(r'<td data-label="Event">([^<]*)</td>.*?<td data-label="By">([^<]*)</td>', page, re.S)
    assert [(event.strip(), by.strip()) for event, by in rows] == [
        ("claimed", f"{PRINCIPAL} (principal)"),
        ("retry", "commitgate"),
        ("succeeded", "commitgate"),
    ], page


def test_an_operators_resolution_names_the_operator(tmp_path: Path) -> None:
    deployment = Deployment.create(tmp_path, principal=PRINCIPAL)
    op_id = asyncio.run(claim(deployment.ledger, principal=PRINCIPAL, tool="send_email", step="s-1"))
    resolved = ops(deployment, "resolve", op_id, "--failed", "--reason", "not in the outbox", "--by", "olga")
    assert resolved.returncode == 0, resolved.stderr
    assert history(deployment, op_id)[-1] == ("resolved", "olga", "operator")


def test_an_actor_is_stored_as_its_role_and_name_and_read_back() -> None:
    from commitgate.server.model.audit import COMMITGATE, Actor, AuditEvent

    assert (str(Actor.principal("alice")), str(Actor.operator("bob")), str(COMMITGATE)) == (
        "principal:alice",
        "operator:bob",
        "commitgate",
    )
    for actor in (Actor.principal("alice"), Actor.operator("bob"), COMMITGATE):
        assert Actor.of_record(str(actor), AuditEvent.SUCCEEDED, "alice") == actor
