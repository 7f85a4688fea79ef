"""`commitgate demo`: a real MCP client session against real server processes.

Shows, on the bundled demo tools and a throwaway ledger and sandbox: a first
call, a replay, a conflicting reuse of a key, a lost acknowledgement
reconciled by a status check, a large refund that waits for a person's approval
(given with `commitgate ops approve`), a `kill -9` of the server mid-operation and the
recovery, the double-charge experiment in small (a naive client vs the
same agent through commitgate), and a charge refused by a spending budget.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from mcp import MCPError
from rich.console import Console
from rich.table import Table

from commitgate.server.demo.sandbox import NAIVE_POLICY, Sandbox, connect, kill_servers
from commitgate.server.model.facts import OPERATION_META

console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)


@dataclass
class Step:
    what: str  # the situation, in a few words
    answer: str  # what the agent was told
    happened: str  # what the payments/email store really holds
    ok: bool  # commitgate behaved as it should
    verdict: str = ""  # shown instead of yes/NO where a row is the baseline, not a check


def _op(result: Any) -> dict[str, Any]:
    return dict((result.meta or {}).get(OPERATION_META) or {})


def _code(result: Any) -> str:
    if not result.is_error:
        return "ok"
    return str((result.structured_content or {}).get("error", {}).get("code"))


def say(number: int, title: str, did: str, saw: str, why: str) -> None:
    """One step: what the agent did, what happened, and why that is the right outcome."""
    console.print(f"\n[bold]{number}. {title}[/]")
    console.print(f"   [dim]did:[/]  {did}")
    console.print(f"   [dim]saw:[/]  {saw}")
    console.print(f"   [dim]why it matters:[/] {why}")


def times(n: int, thing: str) -> str:
    plural = thing[:-1] + "ies" if thing.endswith("y") else thing + "s"
    return f"{n} {thing}" if n == 1 else f"{n} {plural}"


async def scenario_basics(box: Sandbox, steps: list[Step]) -> None:
    charge = {"card": "4242424242424242", "amount_cents": 1999, "idempotency_key": "order-1001-charge"}
    async with connect(box.server(faults="refund.lose_ack=1x")) as client:
        first = await client.call_tool("charge_card", charge)
        charges = box.count("charges")
        say(
            1,
            "A first charge",
            "the agent charges $19.99 to a card, naming the action with the key 'order-1001-charge'.",
            f"the card was charged ({times(charges, 'charge')} in the payments store); "
            "commitgate recorded the outcome under that key.",
            "every later call with the same key will be answered from this record.",
        )
        steps.append(Step("first charge", "charged", times(charges, "charge"), charges == 1))

        again = await client.call_tool("charge_card", charge)
        same = again.structured_content == first.structured_content
        charges = box.count("charges")
        say(
            2,
            "The same charge again (a retry)",
            "the agent sends the identical call once more, as it would after a timeout.",
            f"it got the first answer back{' unchanged' if same else ' (CHANGED)'}, marked as a replay; "
            f"the payments store still holds {times(charges, 'charge')}.",
            "a retry can never charge the card a second time.",
        )
        steps.append(
            Step(
                "retry with the same key",
                "the first answer, replayed",
                times(charges, "charge"),
                charges == 1 and same and _op(again).get("replayed") is True,
            )
        )

        other = await client.call_tool("charge_card", {**charge, "amount_cents": 2999})
        charges = box.count("charges")
        say(
            3,
            "The same key for a different amount",
            "the agent reuses 'order-1001-charge' but asks for $29.99.",
            f"refused with {_code(other)}; nothing was charged ({times(charges, 'charge')} in the store).",
            "a key names one action: reusing it by mistake is caught instead of silently replaying "
            "or charging again.",
        )
        steps.append(
            Step(
                "same key, other amount",
                f"refused ({_code(other)})",
                times(charges, "charge"),
                _code(other) == "idempotency_key_reused" and charges == 1,
            )
        )

        charge_id = first.structured_content["charge_id"]
        refund = await client.call_tool(
            "refund", {"charge_id": charge_id, "amount_cents": 500, "idempotency_key": "order-1001-refund"}
        )
        status = await client.call_tool("get_operation_status", {"idempotency_key": "order-1001-refund"})
        recon = (status.structured_content or {}).get("operation", {}).get("reconciliation", {})
        refunds = box.count("refunds")
        found = recon.get("verdict") == "found"
        say(
            4,
            "A refund whose answer is lost",
            "the agent refunds $5; the refund goes through but its answer never comes back.",
            "commitgate asked the payments system whether that refund exists"
            f"{' and found it' if found else ''}, so the agent was told it succeeded; "
            f"{times(refunds, 'refund')} in the store.",
            "an answer lost on the way is not a reason to refund twice, nor to leave the agent guessing.",
        )
        steps.append(
            Step(
                "refund, answer lost",
                "succeeded (checked with the payments system)",
                times(refunds, "refund"),
                refunds == 1 and not refund.is_error,
            )
        )


async def scenario_approval(box: Sandbox, steps: list[Step]) -> None:
    """A refund over $100 waits for a person; an operator approves it from the command line."""
    charge = {"card": "4000056655665556", "amount_cents": 25000, "idempotency_key": "order-1003-charge"}
    refund_args = {"amount_cents": 15000, "idempotency_key": "order-1003-refund"}
    async with connect(box.server()) as client:
        charge_id = (await client.call_tool("charge_card", charge)).structured_content["charge_id"]
        refund_args["charge_id"] = charge_id
        first = await client.call_tool("refund", refund_args)
        pending = _code(first)
        operation_id = str(_op(first).get("operation_id"))
        approved = await anyio.to_thread.run_sync(box.ops, ["approve", operation_id, "--by", "demo-operator"])
        retries = [await client.call_tool("refund", refund_args) for _ in range(3)]
    refunds = box.count("refunds", charge_id=charge_id)
    ran = [r for r in retries if not r.is_error and _op(r).get("replayed") is False]
    say(
        5,
        "A large refund waits for a person",
        "the agent refunds $150 of a $250 charge; the policy asks a person to approve refunds over $100. "
        f"An operator runs `commitgate ops approve {operation_id}`; the agent retries three times.",
        f"the first call answered {pending} and refunded nothing; after the approval the first retry "
        f"refunded and the others replayed it: {times(refunds, 'refund')} of that charge.",
        "a person says yes before the effect, and the yes still means exactly one refund.",
    )
    steps.append(
        Step(
            "large refund, approved from the CLI",
            f"{pending}, then refunded",
            times(refunds, "refund"),
            pending == "approval_pending" and approved == 0 and refunds == 1 and len(ran) == 1,
        )
    )


async def scenario_crash(box: Sandbox, steps: list[Step]) -> None:
    charge = {"card": "5555555555554444", "amount_cents": 4200, "idempotency_key": "order-1002-charge"}
    before = box.count("charges")
    with contextlib.suppress(Exception):
        async with (
            connect(box.server(faults="charge_card.timeout_after_effect=60s")) as client,
            anyio.create_task_group() as group,
        ):
            group.start_soon(_unanswered, client, "charge_card", charge)
            with anyio.move_on_after(30):  # the server charges, then waits 60 s before recording it
                while box.count("charges") == before:
                    await anyio.sleep(0.02)
            kill_servers(str(box.root))
            group.cancel_scope.cancel()  # its answer never comes
    async with connect(box.server()) as client:
        status = await client.call_tool(
            "get_operation_status", {"idempotency_key": charge["idempotency_key"]}
        )
        op = (status.structured_content or {}).get("operation") or {}
        retry = await client.call_tool("charge_card", charge)
    charges = box.count("charges") - before
    say(
        6,
        "The server is killed in the middle of a charge",
        "the card is charged, then the server process is killed (kill -9) before it can write down "
        "the outcome; a new server starts and the agent asks about its key, then retries.",
        f"the new server checked with the payments system, found the charge and answered "
        f"{op.get('state')}; the retry got that answer back; {times(charges, 'charge')} for this order.",
        "a crash at the worst moment neither loses the charge nor makes the retry charge again.",
    )
    steps.append(
        Step(
            "server killed mid-charge, restarted",
            f"{op.get('state')} (checked with the payments system)",
            times(charges, "charge"),
            charges == 1 and op.get("state") == "SUCCEEDED" and _op(retry).get("replayed") is True,
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
    say(
        7,
        "A crash after an email that cannot be looked up",
        "an email goes out, then the server crashes before recording it; email has no way to ask "
        "'was it sent?', and the agent retries.",
        f"the retry was not sent; it answered {_code(retry)} (may or may not have happened; "
        f"check before acting); {times(emails, 'email')} sent.",
        "when nobody can know, commitgate says so instead of guessing: a person or a later check "
        "decides (`commitgate ops resolve`), and the customer never gets the email twice.",
    )
    steps.append(
        Step(
            "crash after an email, retry",
            f"not sent again ({_code(retry)})",
            times(emails, "email"),
            emails == 1 and _code(retry) == "operation_outcome_unknown",
        )
    )


async def _unanswered(client: Any, tool: str, arguments: dict[str, Any]) -> None:
    """A call whose server is killed before it answers."""
    with contextlib.suppress(MCPError):
        await client.call_tool(tool, arguments)


async def scenario_budget(box: Sandbox, steps: list[Step], number: int) -> None:
    """The bundled policy caps what one caller may charge within a day: a charge past it is refused."""
    card = "378282246310005"  # a card no earlier step uses: the count is this step's alone
    first = {"card": card, "amount_cents": 600_000, "idempotency_key": "order-2001-charge"}
    second = {"card": card, "amount_cents": 500_000, "idempotency_key": "order-2002-charge"}
    async with connect(box.server(ledger="budget.db")) as client:
        await client.call_tool("charge_card", first)
        refused = await client.call_tool("charge_card", second)
    budget = (refused.structured_content or {}).get("error", {}).get("budget") or {}
    charges = box.count("charges", card=card)
    say(
        number,
        "A charge past the spending budget",
        "the agent charges $6,000 for one order, then $5,000 for another; the bundled policy lets one "
        "caller charge at most $10,000 within any day (budget 'payments').",
        f"the first went through; the second was refused with {_code(refused)} (spent "
        f"${budget.get('spent', 0) / 100:,.0f} of ${budget.get('limit', 0) / 100:,.0f} within "
        f"{budget.get('window')}) and nothing was charged: {times(charges, 'charge')} on that card.",
        "a cap on spending holds even for concurrent calls; `commitgate ops budgets` shows what was spent.",
    )
    steps.append(
        Step(
            "charge past the spending budget",
            f"refused ({_code(refused)})",
            times(charges, "charge"),
            _code(refused) == "budget_exceeded" and charges == 1,
        )
    )


async def double_charge(box: Sandbox, bookings: int, guarded: bool) -> dict[str, int]:
    """Bookings by an agent that retries until it hears back, while half of the answers are lost."""
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
        checked = await _checked_answers(client, bookings) if guarded else 0
    charges = sum(box.count("charges", card=f"{card_prefix}-{n}") for n in range(bookings))
    return {
        "bookings": bookings,
        "charges": charges,
        "duplicates": charges - bookings,
        "retries": retries,
        "checked": checked,
    }


async def _checked_answers(client: Any, bookings: int) -> int:
    """Charges whose answer was lost and that commitgate found by asking the payments store."""
    listed = await client.call_tool("list_operations", {"tool": "charge_card", "limit": bookings})
    operations = (listed.structured_content or {}).get("operations", [])
    return sum(1 for op in operations if (op.get("reconciliation") or {}).get("verdict") == "found")


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """The arguments of `commitgate demo`."""
    demo.add_argument(
        "--quick", action="store_true", help="a shorter run: fewer calls per step (default: off)"
    )
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    return asyncio.run(run_demo(quick=args.quick))


async def run_demo(quick: bool = False) -> int:
    random.seed(7)
    with tempfile.TemporaryDirectory(prefix="commitgate-demo-") as tmp:
        box = Sandbox(Path(tmp))
        steps: list[Step] = []
        console.rule("commitgate demo")
        console.print(
            "An agent talks to a real commitgate server over MCP (stdio), which charges cards and sends "
            "emails in a small payments store kept in a temporary folder. Each step does something that "
            "goes wrong in real life and shows what ends up in the store."
        )
        await scenario_basics(box, steps)
        await scenario_approval(box, steps)
        await scenario_crash(box, steps)
        bookings = 10 if quick else 40
        naive = await double_charge(box, bookings, guarded=False)
        guarded = await double_charge(box, bookings, guarded=True)
        say(
            8,
            "Many bookings while half of the answers get lost",
            f"the same agent makes {bookings} bookings twice: once calling the payment tool directly, once "
            "through commitgate; half of the 'charged' answers are lost, and the agent retries until it "
            "hears back.",
            f"directly: {naive['charges']} charges for {bookings} bookings, "
            f"{times(naive['duplicates'], 'extra charge')}; through commitgate: {guarded['charges']} charges, "
            f"{times(guarded['duplicates'], 'extra charge')}, and {times(guarded['retries'], 'retry')}: for "
            f"each of the {times(guarded['checked'], 'lost answer')} commitgate asked the payments store "
            "whether the charge exists, found it, and gave the agent its answer.",
            "agents retry; with commitgate the retries are free of double charges, and most are not needed.",
        )
        steps.append(
            Step(
                f"{bookings} bookings, calling the tool directly",
                f"{times(naive['retries'], 'retry')}",
                f"{naive['charges']} charges, {naive['duplicates']} extra",
                True,
                verdict="the problem",
            )
        )
        steps.append(
            Step(
                f"{bookings} bookings through commitgate",
                f"{times(guarded['retries'], 'retry')} ({guarded['checked']} lost answers checked with the"
                " payments store)",
                f"{guarded['charges']} charges, {guarded['duplicates']} extra",
                guarded["duplicates"] == 0,
            )
        )
        await scenario_budget(box, steps, 9)
        console.print()
        console.print(summary_table(steps))
        all_good = all(step.ok for step in steps)
        console.print(
            "Every step ended as it should: one effect per action, whatever went wrong."
            if all_good
            else "[red]Some step did not end as it should (marked NO above).[/]"
        )
        console.print(NEXT_STEPS)
        return 0 if all_good else 1


def summary_table(steps: list[Step]) -> Table:
    table = Table(title="What happened")
    for column in ("step", "what the agent was told", "what the store really holds", "as it should be?"):
        table.add_column(column)
    for step in steps:
        verdict = step.verdict or ("[green]yes[/]" if step.ok else "[red]NO[/]")
        table.add_row(step.what, step.answer, step.happened, verdict)
    return table


NEXT_STEPS = """
[bold]What to try next[/]
  commitgate serve                       serve these demo tools to your own MCP client (stdio)
  commitgate claude-config               the entry that adds them to Claude Desktop
  commitgate policy show                 each tool and how it is guarded
  commitgate ops list                    what the server recorded (after you used it)
  commitgate ops budgets                 what was spent against each budget
  COMMITGATE_SANDBOX_FAULTS="charge_card.lose_ack=50%" commitgate serve
                                         lose half of the charge answers and watch retries stay safe
  commitgate bench                       the full measurements behind the last step
"""
