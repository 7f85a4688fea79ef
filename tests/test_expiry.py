"""Every reader touches the same way: an operation whose owner's lease ran out reads UNKNOWN through
`commitgate ops list`, a console page, `list_operations` and a poll, written once, whoever reads first.

Real files and processes: a SQLite ledger, `commitgate ops` and `commitgate serve` as subprocesses,
the console app over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from pathlib import Path

import anyio
import pytest
from support.console import claim, console_client, loopback_access
from support.e2e import CONSOLE_SCRIPT, Deployment, serve

from commitgate.server.ledger import open_ledger
from commitgate.server.model.facts import State

pytestmark = pytest.mark.slow

PRINCIPAL = "agent"
# Each operation (its own session and key) is read first by another reader.
KEYS = ("first-ops-list", "first-console-page", "first-console-listing")
STATE = re.compile(r'<span class="state state-\w+">(\w+)</span>')


def ops_list(d: Deployment, *flags: str) -> dict[str, str]:
    """`commitgate ops list --json`: the state it shows, per idempotency key."""
    command = [str(CONSOLE_SCRIPT), "ops", "list", "--ledger", f"sqlite:///{d.ledger}", "--json", *flags]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    return {op["idempotency_key"]: op["state"] for op in json.loads(done.stdout)["operations"]}


def console_states(d: Deployment, ids: dict[str, str], *, listing: bool = False) -> dict[str, str]:
    """The state each operation's console page shows (after the operations listing, when `listing`)."""
    states = {}
    with console_client(f"sqlite:///{d.ledger}", loopback_access()) as client:
        if listing:
            assert client.get("/operations").status_code == 200
        for key, op_id in ids.items():
            page = client.get(f"/operations/{op_id}")
            assert page.status_code == 200, page.text
            found = STATE.search(page.text)
            assert found is not None, page.text
            states[key] = found.group(1)
    return states


async def recorded(d: Deployment, ids: dict[str, str]) -> dict[str, tuple[str, int]]:
    """Straight from the ledger: each operation's state and how many lease expiries its audit holds."""
    ledger = await open_ledger(f"sqlite:///{d.ledger}", read_only=True)
    try:
        found = {}
        for key, op_id in ids.items():
            op = await ledger.get_by_id(None, op_id)
            assert op is not None
            history = await ledger.history(op_id)
            found[key] = (op.state.value, sum(entry.event == "lease_expired" for entry in history))
        return found
    finally:
        await ledger.close()


def test_an_expired_lease_reads_unknown_through_every_reader_written_once(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path, principal=PRINCIPAL)
    lapsed = time.time() - 120  # claimed two minutes ago with a 60 s lease, by a process elsewhere
    ids = {
        key: asyncio.run(
            claim(
                d.ledger,
                principal=PRINCIPAL,
                session=key,
                step=key,
                tool="send_email",
                state=State.RUNNING,
                at=lapsed,
            )
        )
        for key in KEYS
    }
    untouched = ("RUNNING", 0)

    # No server runs yet (its sweep would move them all): each reader moves what it reads, only that.
    assert ops_list(d, "--session", KEYS[0]) == {KEYS[0]: "UNKNOWN"}
    assert asyncio.run(recorded(d, ids)) == {KEYS[0]: ("UNKNOWN", 1), KEYS[1]: untouched, KEYS[2]: untouched}
    assert console_states(d, {KEYS[1]: ids[KEYS[1]]}) == {KEYS[1]: "UNKNOWN"}
    assert asyncio.run(recorded(d, ids))[KEYS[1]] == ("UNKNOWN", 1)
    assert asyncio.run(recorded(d, ids))[KEYS[2]] == untouched
    console_states(d, {}, listing=True)  # a listing sweeps, as the server's sweep would

    async def through_the_server() -> tuple[dict[str, str], dict[str, str]]:
        async with serve(d) as server:
            listed = {op["idempotency_key"]: op["state"] for op in await server.operations()}
            polled = {
                key: (await server.status(key, idempotency_key=key))["operation"]["state"] for key in KEYS
            }
        return listed, polled

    listed, polled = anyio.run(through_the_server)
    everywhere = dict.fromkeys(KEYS, "UNKNOWN")
    assert listed == everywhere and polled == everywhere
    assert ops_list(d) == everywhere
    assert console_states(d, ids) == everywhere
    assert asyncio.run(recorded(d, ids)) == dict.fromkeys(KEYS, ("UNKNOWN", 1))  # one transition each
