"""Edits that weaken a guard wait for a quiet file; edits that tighten apply at once.

The comparison (policy/guards.py) on its own, then a real `commitgate serve` process whose policy
an editor rewrites in place: first a prefix that is valid TOML without the tool's approval line,
the rest 1.5 s later. A call made in between still waits for approval; effects are counted in the
demo sandbox.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import anyio
import pytest
from support.http_servers import Served, connect, error_code, running

from commitgate.server.policy.guards import weakenings
from commitgate.server.policy.loading import loads_policy

HEADER = """
[server]
name = "commitgate-reload-guards"

[ledger]
synchronous = "NORMAL"

[tools.create_ticket]
class = "key-required"
python = "commitgate.tools.demo:create_ticket"

[tools.send_email]
class = "key-required"
python = "commitgate.tools.demo:send_email"
"""
APPROVAL = 'approval = { via = ["operator"] }\n'
FULL = HEADER + APPROVAL
PREFIX = HEADER  # valid on its own: the same tools, without the approval line that ends the file
EMAIL = {"to": "team@example.com", "subject": "s", "body": "b"}
DEADLINE = 30.0


def test_what_weakens_a_guard_and_what_only_tightens() -> None:
    budget = '[budgets.b]\namount = "1"\nlimit = 10\nwindow = "1h"\n'
    ticket = '[tools.create_ticket]\nclass = "key-required"\npython = "commitgate.tools.demo:create_ticket"\n'
    base = loads_policy(FULL + budget)

    def edited(old: str, new: str) -> list[str]:
        assert old in FULL + budget
        return weakenings(base, loads_policy((FULL + budget).replace(old, new)))

    assert edited(APPROVAL, "") == ["tools.send_email.approval: removed"]
    assert edited('via = ["operator"]', 'via = ["client", "operator"]') == [
        "tools.send_email.approval.via: now also decided via client"
    ]
    assert edited("limit = 10", "limit = 11") == ["budgets.b.limit: raised"]
    assert edited(budget, "") == ["budgets.b: removed"]
    assert edited(ticket, ticket.replace("key-required", "safe-retry")) == [
        "tools.create_ticket.class: a keyed tool moved to safe-retry"
    ]
    assert edited(ticket, ticket + "duplicates = false\n") == ["tools.create_ticket.duplicates: turned off"]
    refund = '[tools.refund]\nclass = "key-required"\npython = "commitgate.tools.demo:refund"\n'
    assert edited(budget, budget + refund) == ["tools.refund: a tool added without approval"]
    token = '[[auth.tokens]]\nprincipal = "ops"\nrole = "operator"\ntoken_sha256 = "' + "a" * 64 + '"\n'
    assert edited(budget, budget + token) == ["auth.tokens[0]: a token added"]
    # Tightening only: a limit lowered, a tool removed, an approval added.
    assert edited("limit = 10", "limit = 9") == []
    assert edited(ticket, "") == []
    assert edited(ticket, ticket + APPROVAL) == []


def count(root: Path, table: str) -> int:
    """Rows of a sandbox table; none before the first effect created it."""
    with sqlite3.connect(root / "sandbox.db") as conn:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (table,)).fetchone() is None:
            return 0
        return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def logged(served: Served, words: str) -> int:
    """How many of the server's log lines carry `words`."""
    lines = [line for line in served.stderr().splitlines() if line.startswith("{")]
    return sum(words in str(json.loads(line).get("msg", "")) for line in lines)


def wait_for(check: object, what: str) -> float:
    """Poll `check` until true; the seconds it took."""
    start = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - start < DEADLINE, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


async def send(served: Served, key: str) -> str | None:
    async with connect(served, None, "legacy") as client:
        arguments = {**EMAIL, "subject": key, "idempotency_key": key}  # distinct: not a duplicate
        return error_code(await client.call_tool("send_email", arguments))


@pytest.mark.slow
def test_a_half_written_policy_never_serves_without_the_approval_its_full_text_keeps(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(FULL, encoding="utf-8")
    with running(
        tmp_path, policy, "streamable-http", ledger=tmp_path / "ledger.db", sandbox=tmp_path / "sandbox.db"
    ) as served:
        assert anyio.run(send, served, "e-0") == "approval_pending"

        policy.write_text(PREFIX, encoding="utf-8")  # in place, as some editors save: the prefix first
        written = time.monotonic()
        wait_for(lambda: logged(served, "weakens a guard") + logged(served, "applied") >= 1, "the edit")
        assert anyio.run(send, served, "e-1") == "approval_pending"  # the running policy still serves
        time.sleep(max(0.0, 1.5 - (time.monotonic() - written)))
        policy.write_text(FULL, encoding="utf-8")  # ... and the rest 1.5 s later
        time.sleep(1.5)  # past the moment the prefix alone would have applied
        assert anyio.run(send, served, "e-2") == "approval_pending"
        assert count(tmp_path, "emails") == 0 and logged(served, "applied") == 0

        # Meant: the approval removed for good applies once the file is quiet, without another event.
        policy.write_text(PREFIX, encoding="utf-8")
        took = wait_for(lambda: logged(served, "applied") == 1, "the quiet edit to apply")
        assert took >= 2.0 and logged(served, "weakens a guard") == 2
        assert anyio.run(send, served, "e-3") is None and count(tmp_path, "emails") == 1

        # Tightening: the approval back applies at once, with no wait announced.
        policy.write_text(FULL, encoding="utf-8")
        wait_for(lambda: logged(served, "applied") == 2, "the tightening edit")
        assert logged(served, "weakens a guard") == 2
        assert anyio.run(send, served, "e-4") == "approval_pending" and count(tmp_path, "emails") == 1
