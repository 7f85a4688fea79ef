"""`commitgate demo`: a real MCP client session against real server processes.

Shows, on the bundled demo tools and a throwaway ledger and sandbox: a first
call, a replay, a conflicting reuse of a key, a lost acknowledgement
reconciled by a status check, a `kill -9` of the server mid-operation and the
recovery, and the double-charge experiment in small (a naive client vs the
same agent through commitgate).
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from mcp import MCPError
from rich.console import Console
from rich.table import Table

from commitgate.server.demo.sandbox import NAIVE_POLICY, Sandbox, connect, kill_servers
from commitgate.server.model.facts import OPERATION_META

console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)


@dataclass
class Step:
    what: str
    outcome: str
    effects: str
    ok: bool


def _op(result: Any) -> dict[str, Any]:
    return dict((result.meta or {}).get(OPERATION_META) or {})


def _code(result: Any) -> str:
    if not result.is_error:
        return "ok"
    return str((result.structured_content or {}).get("error", {}).get("code"))


async def scenario_basics(box: Sandbox, steps: list[Step]) -> None:
    charge = {"card": "4242424242424242", "amount_cents": 1999, "idempotency_key": "order-1001-charge"}
    async with connect(box.server(faults="refund.lose_ack=1x")) as client:
        first = await client.call_tool("charge_card", charge)
        op = _op(first)
        console.print(
            f"[bold]1. first call[/]  charge_card key={charge['idempotency_key']} -> {first.structured_content}"
        )
        steps.append(
            Step(
                "first call",
                f"{op.get('state')}, replayed={op.get('replayed')}",
                f"charges={box.count('charges')}",
                box.count("charges") == 1,
            )
        )

        again = await client.call_tool("charge_card", charge)
        same = again.structured_content == first.structured_content
        console.print(
            f"[bold]2. replay[/]      same key again -> replayed={_op(again).get('replayed')}, identical result: {same}"
        )
        steps.append(
            Step(
                "replay (same key)",
                f"replayed={_op(again).get('replayed')}, identical={same}",
                f"charges={box.count('charges')}",
                box.count("charges") == 1 and same,
            )
        )

        other = await client.call_tool("charge_card", {**charge, "amount_cents": 2999})
        console.print(f"[bold]3. conflict[/]    same key, other amount -> {_code(other)}")
        steps.append(
            Step(
                "same key, other arguments",
                _code(other),
                f"charges={box.count('charges')}",
                _code(other) == "idempotency_key_reused" and box.count("charges") == 1,
            )
        )

        charge_id = first.structured_content["charge_id"]
        refund = await client.call_tool(
            "refund", {"charge_id": charge_id, "amount_cents": 500, "idempotency_key": "order-1001-refund"}
        )
        status = await client.call_tool("get_operation_status", {"idempotency_key": "order-1001-refund"})
        recon = (status.structured_content or {}).get("operation", {}).get("reconciliation", {})
        console.print(
            f"[bold]4. lost ack[/]    refund applied but its acknowledgement was lost -> status check "
            f"{recon.get('verdict')} -> {_op(refund).get('state')}"
        )
        steps.append(
            Step(
                "lost acknowledgement (refund)",
                f"{_op(refund).get('state')} via status check",
                f"refunds={box.count('refunds')}",
                box.count("refunds") == 1 and not refund.is_error,
            )
        )


async def scenario_crash(box: Sandbox, steps: list[Step]) -> None:
    charge = {"card": "5555555555554444", "amount_cents": 4200, "idempotency_key": "order-1002-charge"}
    before = box.count("charges")
    with contextlib.suppress(Exception):
        async with connect(box.server(faults="charge_card.timeout_after_effect=60s")) as client:
            with contextlib.suppress(MCPError, TimeoutError):
                await client.call_tool("charge_card", charge, read_timeout_seconds=2)
            killed = kill_servers(str(box.root))
            console.print(
                f"[bold]5. kill -9[/]     charge applied, server killed before recording it ({killed} process)"
            )
            await anyio.sleep(0.2)
    async with connect(box.server()) as client:
        status = await client.call_tool(
            "get_operation_status", {"idempotency_key": charge["idempotency_key"]}
        )
        op = (status.structured_content or {}).get("operation") or {}
        retry = await client.call_tool("charge_card", charge)
    charges = box.count("charges") - before
    console.print(
        f"              restarted; poll -> {op.get('state')} ({op.get('retry_advice')}), "
        f"retry -> replayed={_op(retry).get('replayed')}; charges for this order: {charges}"
    )
    steps.append(
        Step(
            "kill -9 mid-operation, restart",
            f"{op.get('state')} after reconciliation",
            f"charges={charges}",
            charges == 1 and op.get("state") == "SUCCEEDED",
        )
    )

    email = {
        "to": "ana@example.com",
        "subject": "Receipt",
        "body": "Thanks!",
        "idempotency_key": "order-1002-receipt",
    }
    with contextlib.suppress(Exception):
        async with connect(box.server(faults="send_email.crash_after_effect=1x")) as client:
            await client.call_tool("send_email", email)
    async with connect(box.server()) as client:
        retry = await client.call_tool("send_email", email)
    emails = box.count("emails")
    console.print(
        f"[bold]6. crash[/]       email sent, server crashed before recording; retry -> {_code(retry)}; emails: {emails}"
    )
    steps.append(
        Step(
            "crash after email, retry",
            _code(retry),
            f"emails={emails}",
            emails == 1 and _code(retry) == "operation_outcome_unknown",
        )
    )


async def double_charge(box: Sandbox, bookings: int, guarded: bool) -> dict[str, int]:
    """Seed experiment 1 in small: 50 % of acknowledgements lost after commit."""
    faults = "charge_card.lose_ack=50%"
    policy = None
    if not guarded:
        policy = box.root / "naive.toml"
        policy.write_text(NAIVE_POLICY)
    card_prefix = "guarded" if guarded else "naive"
    retries = 0
    async with connect(box.server(faults=faults, policy=policy, ledger=f"{card_prefix}.db")) as client:
        for n in range(bookings):
            arguments: dict[str, Any] = {"card": f"{card_prefix}-{n}", "amount_cents": 100}
            if guarded:
                arguments["idempotency_key"] = f"booking-{n}"
            while (await client.call_tool("charge_card", arguments)).is_error:
                retries += 1  # the agent did not see success: it tries again
    charges = sum(box.count("charges", card=f"{card_prefix}-{n}") for n in range(bookings))
    return {"bookings": bookings, "charges": charges, "duplicates": charges - bookings, "retries": retries}


async def run_demo(quick: bool = False) -> int:
    random.seed(7)
    with tempfile.TemporaryDirectory(prefix="commitgate-demo-") as tmp:
        box = Sandbox(Path(tmp))
        steps: list[Step] = []
        console.rule("commitgate demo: a real MCP client against a real server process (stdio)")
        await scenario_basics(box, steps)
        await scenario_crash(box, steps)
        bookings = 10 if quick else 40
        naive = await double_charge(box, bookings, guarded=False)
        guarded = await double_charge(box, bookings, guarded=True)
        console.print(
            f"[bold]7. double charge[/] {bookings} bookings, 50 % of acknowledgements lost: "
            f"naive client {naive['duplicates']} duplicate charges, through commitgate {guarded['duplicates']}"
        )
        steps.append(
            Step(
                f"naive client, {bookings} bookings",
                f"{naive['retries']} retries",
                f"duplicates={naive['duplicates']}",
                True,
            )
        )
        steps.append(
            Step(
                f"through commitgate, {bookings} bookings",
                f"{guarded['retries']} retries",
                f"duplicates={guarded['duplicates']}",
                guarded["duplicates"] == 0,
            )
        )
        table = Table(title="What happened")
        for column in ("step", "answer", "effects in the system of record", "as expected"):
            table.add_column(column)
        for step in steps:
            table.add_row(step.what, step.outcome, step.effects, "[green]yes[/]" if step.ok else "[red]NO[/]")
        console.print(table)
        return 0 if all(step.ok for step in steps) else 1
