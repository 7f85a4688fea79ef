"""Edits that weaken a guard wait for a quiet file; edits that tighten apply at once.

The comparison (policy/guards.py) on its own, then a real `commitgate serve` process whose policy
an editor rewrites in place: first a prefix that is valid TOML without the tool's approval line,
the rest 1.5 s later. A call made in between still waits for approval; effects are counted in the
demo sandbox.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
import pytest
from support.http_servers import Served, connect, error_code, running
from support.postgres import fresh_url

from commitgate.server.policy.guards import weakenings
from commitgate.server.policy.loading import loads_policy

HEADER = """
[server]
name = "commitgate-reload-guards"

[ledger]
synchronous = "NORMAL"

[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"

[tools.send_email]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
"""
APPROVAL = 'approval = { via = ["operator"] }\n'
FULL = HEADER + APPROVAL
PREFIX = HEADER  # valid on its own: the same tools, without the approval line that ends the file
EMAIL = {"to": "team@example.com", "subject": "s", "body": "b"}
DEADLINE = 30.0


def test_what_weakens_a_guard_and_what_only_tightens() -> None:
    budget = '[budgets.b]\namount = "1"\nlimit = 10\nwindow = "1h"\n'
    ticket = '[tools.create_ticket]\nclass = "key-required"\npython = "commitgate.server.demo.tools:create_ticket"\n'
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
    refund = '[tools.refund]\nclass = "key-required"\npython = "commitgate.server.demo.tools:refund"\n'
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


HINTED = Path(__file__).resolve().parent / "support" / "hinted_server.py"


def upstream_policy(root: Path, default_class: str = "key-required", entry: bool = True) -> str:
    """A `tools = "all"` upstream (tests/support/hinted_server.py), and an entry that holds its
    `note` for an operator's approval (last, so that the file without it is a prefix of the file)."""
    text = (
        '[server]\nname = "commitgate-reload-upstream"\n\n[ledger]\nsynchronous = "NORMAL"\n\n'
        f'[upstreams.h]\ncommand = "{sys.executable}"\nargs = ["{HINTED}"]\n'
        f'env = {{ HINTED_EFFECTS = "{root / "effects.jsonl"}" }}\n'
        f'tools = "all"\ndefault_class = "{default_class}"\n'
    )
    held = '\n[tools.note]\nupstream = "h"\nclass = "key-required"\napproval = { via = ["operator"] }\n'
    return text + (held if entry else "")


def upstream_effects(root: Path) -> list[str]:
    path = root / "effects.jsonl"
    return [json.loads(line)["tool"] for line in path.read_text().splitlines()] if path.exists() else []


async def call_upstream(served: Served, tool: str, arguments: Mapping[str, object]) -> str | None:
    async with connect(served, None, "legacy") as client:
        return error_code(await client.call_tool(tool, dict(arguments)))


def edit_back_soon(
    served: Served,
    policy: Path,
    weaker: str,
    full: str,
    tool: str,
    arguments: Callable[[int], dict[str, object]],
) -> list[str | None]:
    """Write `weaker` in place and call `tool` again and again (each call with `arguments(n)`) until
    1 s after the server saw the edit, then write `full` back: before the 2 s of quiet the weaker
    text needs to apply. The answer codes."""
    seen = logged(served, "weakens a guard") + logged(served, "applied")
    policy.write_text(weaker, encoding="utf-8")
    written, noticed, answers = time.monotonic(), None, list[str | None]()
    while noticed is None or time.monotonic() - noticed < 1.0:
        answers.append(anyio.run(call_upstream, served, tool, arguments(len(answers))))
        if noticed is None and logged(served, "weakens a guard") + logged(served, "applied") > seen:
            noticed = time.monotonic()
        assert time.monotonic() - written < DEADLINE, "the server never saw the edit"
    policy.write_text(full, encoding="utf-8")
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_weakening_what_a_tools_all_upstream_serves_waits_for_a_quiet_file(
    tmp_path: Path, backend: str
) -> None:
    """What is compared is what will be served: the entry of a tool its upstream still offers dropped
    (with its approval), or `default_class` loosened to safe-retry, each waits like any weakening."""
    policy = tmp_path / "policy.toml"
    full = upstream_policy(tmp_path)
    policy.write_text(full, encoding="utf-8")
    note = {"text": "hello", "idempotency_key": "n-1"}
    ledger = anyio.run(fresh_url) if backend == "postgres" else tmp_path / "ledger.db"
    with running(
        tmp_path, policy, "streamable-http", ledger=ledger, sandbox=tmp_path / "sandbox.db"
    ) as served:
        wait_for(lambda: logged(served, "upstream tools refreshed") >= 1, "the upstream's tools")
        assert anyio.run(call_upstream, served, "note", note) == "approval_pending"

        # The entry dropped (the file's prefix): `note` would come back from the upstream unapproved.
        dropped = upstream_policy(tmp_path, entry=False)
        assert full.startswith(dropped)
        notes = edit_back_soon(
            served, policy, dropped, full, "note", lambda n: {"text": f"t{n}", "idempotency_key": f"a-{n}"}
        )
        assert set(notes) == {"approval_pending"}
        # default_class loosened: `tally` (it declares only idempotentHint) would run without a key.
        loosened = upstream_policy(tmp_path, "safe-retry")
        tallies = edit_back_soon(served, policy, loosened, full, "tally", lambda n: {"n": n})  # no key
        assert set(tallies) == {"idempotency_key_required"}
        time.sleep(2.5)  # past the moment either edit alone would have applied
        assert anyio.run(call_upstream, served, "note", note) == "approval_pending"
        assert upstream_effects(tmp_path) == [] and logged(served, "applied") == 0
        assert logged(served, "weakens a guard") == 2

        # Meant: the entry removed for good applies once the file is quiet; `note` then runs keyed.
        policy.write_text(dropped, encoding="utf-8")
        took = wait_for(lambda: logged(served, "applied") == 1, "the quiet edit to apply")
        assert took >= 2.0
        assert anyio.run(call_upstream, served, "note", {"text": "meant", "idempotency_key": "n-2"}) is None
        assert upstream_effects(tmp_path) == ["note"]
