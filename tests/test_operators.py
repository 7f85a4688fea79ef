"""Who may say yes: agents' tokens call MCP only, operators' tokens use the console and /metrics only.

End to end through real processes: `commitgate serve` over streamable HTTP on loopback, and
`commitgate console` bound to 0.0.0.0 inside its own network namespace (`unshare -n`, so nothing
listens on this machine's real interfaces); the test reaches it from a thread that joined that
namespace. Both share one SQLite ledger; effects are counted in the demo sandbox.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx2
import pytest
from support.console import csrf_of
from support.e2e import as_meta
from support.http_servers import TOKENS, Served, connect, error_code, running, token_entry

from commitgate.server.cli.main import main
from commitgate.server.ledger import open_ledger

pytestmark = pytest.mark.slow

T = TypeVar("T")
OPERATOR_TOKEN = "ops-carol-token-7d1e5b93a0c4"
EVERY_PRINCIPAL_TOKEN = "ops-dave-token-0b9e4c27f6a1"
SESSION, KEY, ARGUMENT = "sess-7f3a9c02e1", "key-51d0e2b7aa", "arg-93b1c4d8ee"
CLONE_NEWNET = 0x40000000
CONSOLE_PORT = 8766  # a fresh network namespace has every port free
READY_TIMEOUT = 30.0

POLICY = f"""
[server]
name = "commitgate-operators-test"
respond_within = "20s"

[ledger]
synchronous = "NORMAL"

{token_entry("alice", TOKENS["alice"])}
{token_entry("bob", TOKENS["bob"])}
[[auth.tokens]]
principal = "ops-carol"
role = "operator"
principals = ["alice"]
token_sha256 = "{hashlib.sha256(OPERATOR_TOKEN.encode()).hexdigest()}"

[[auth.tokens]]
principal = "ops-dave"
role = "operator"
token_sha256 = "{hashlib.sha256(EVERY_PRINCIPAL_TOKEN.encode()).hexdigest()}"

[budgets.spend]
amount = "arguments.amount_cents"
limit = 100000
window = "1h"

[budgets.per_session]
amount = "arguments.amount_cents"
limit = 1000
window = "1h"
per = "session"

[tools.send_email]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
approval = {{ via = ["operator"] }}

[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
budget = "spend"

[tools.charge_session]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
budget = "per_session"
"""


@dataclass
class Deployment:
    root: Path
    server: Served
    console: subprocess.Popen[bytes]

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.db"

    def count(self, table: str) -> int:
        with sqlite3.connect(self.root / "sandbox.db") as conn:
            return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])

    def approval_of(self, operation_id: str) -> dict[str, Any]:
        with sqlite3.connect(self.ledger) as conn:
            row = conn.execute("SELECT approval FROM operations WHERE operation_id = ?", (operation_id,))
            return dict(json.loads(row.fetchone()[0]))

    def in_console(self, work: Callable[[httpx2.Client], T]) -> T:
        """`work` with an HTTP client inside the console's network namespace."""
        return in_netns(self.console.pid, lambda: _with_client(work))


def _with_client(work: Callable[[httpx2.Client], T]) -> T:
    with httpx2.Client(base_url=f"http://127.0.0.1:{CONSOLE_PORT}", timeout=30) as client:
        return work(client)


def in_netns(pid: int, work: Callable[[], T]) -> T:
    """Run `work` in a thread that joined the network namespace of process `pid` (its sockets live there)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the console's network namespace failed")
        finally:
            os.close(fd)
        try:
            outcome["value"] = work()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def start_console(root: Path, policy: Path) -> subprocess.Popen[bytes]:
    console = [sys.executable, "-m", "commitgate.server.cli", "console", "--policy", str(policy)]
    console += [
        "--ledger",
        f"sqlite:///{root / 'ledger.db'}",
        "--host",
        "0.0.0.0",
        "--port",
        str(CONSOLE_PORT),
    ]
    argv = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', *console]
    log = (root / "console.log").open("wb")
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def wait_console(root: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while b"console at" not in (root / "console.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError((root / "console.log").read_text(errors="replace"))
        time.sleep(0.05)


async def create_ledger(url: str) -> None:
    await (await open_ledger(url)).close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2) to bind the console in its own network")
    root = tmp_path_factory.mktemp("operators")
    policy = root / "policy.toml"
    policy.write_text(POLICY, encoding="utf-8")
    faults = {"COMMITGATE_SANDBOX_FAULTS": "create_ticket.lose_ack=100%"}
    anyio.run(create_ledger, f"sqlite:///{root / 'ledger.db'}")  # so that both processes start at once
    console = start_console(root, policy)
    try:
        with running(
            root,
            policy,
            "streamable-http",
            ledger=root / "ledger.db",
            sandbox=root / "sandbox.db",
            env=faults,
        ) as server:
            wait_console(root, console)
            yield Deployment(root, server, console)
    finally:
        console.terminate()
        console.wait(30)


async def call(
    served: Served, principal: str, tool: str, arguments: dict[str, Any], session: str = "s1"
) -> Any:
    async with connect(served, principal, "legacy") as client:
        return await client.call_tool(tool, arguments, meta=as_meta({"commitgate/session": session}))


def operation_id(result: Any) -> str:
    return str(result.structured_content["error"]["operation"]["operation_id"])


EMAIL = {"to": "ceo@example.com", "subject": "raise", "body": "approve my raise"}
AGENT = {"Authorization": f"Bearer {TOKENS['alice']}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


def test_agent_tokens_are_refused_by_the_console_and_metrics_operator_tokens_by_mcp(
    deployment: Deployment,
) -> None:
    def console_answers(client: httpx2.Client) -> list[httpx2.Response]:
        pages = [client.get(path, headers=AGENT) for path in ("/approvals", "/unknown", "/operations")]
        return [*pages, client.get(f"/approvals?token={TOKENS['alice']}")]

    for answer in deployment.in_console(console_answers):
        assert answer.status_code == 403, answer.text
        assert "agent&#39;s token" in answer.text and "role = &#34;operator&#34;" in answer.text
        assert "set-cookie" not in answer.headers  # no sign-in at all

    metrics = httpx2.get(deployment.server.base + "/metrics", headers=AGENT)
    assert metrics.status_code == 403 and "agent's token" in metrics.json()["error_description"]
    assert httpx2.get(deployment.server.base + "/metrics", headers=OPERATOR).status_code == 200

    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    mcp = httpx2.post(
        deployment.server.endpoint,
        json=initialize,
        headers={**OPERATOR, "Accept": "application/json, text/event-stream"},
    )
    assert mcp.status_code == 403 and "operator's token" in mcp.json()["error_description"]


def test_an_operators_approval_names_the_operator_and_the_call_runs_once(deployment: Deployment) -> None:
    first = anyio.run(call, deployment.server, "alice", "send_email", {**EMAIL, "idempotency_key": "m-1"})
    assert error_code(first) == "approval_pending"
    mine = operation_id(first)
    other = anyio.run(call, deployment.server, "bob", "send_email", {**EMAIL, "idempotency_key": "m-1"})
    theirs = operation_id(other)

    def decide(client: httpx2.Client) -> tuple[int, int, int, bool]:
        page = client.get(f"/operations/{mine}", headers=OPERATOR)
        form = {"csrf_token": csrf_of(page.text), "decision": "approve", "from": "operation"}
        listed = client.get("/approvals", headers=OPERATOR).text
        hidden = client.get(f"/operations/{theirs}", headers=OPERATOR).status_code
        refused = client.post(f"/operations/{theirs}/decide", data=form, headers=OPERATOR).status_code
        approved = client.post(f"/operations/{mine}/decide", data=form, headers=OPERATOR).status_code
        return hidden, refused, approved, mine in listed and theirs not in listed

    assert deployment.in_console(decide) == (404, 404, 303, True)
    record = deployment.approval_of(mine)
    assert (record["by"], record["via"]) == ("ops-carol", "operator")
    assert deployment.approval_of(theirs).get("by") is None  # another principal's call: untouched

    again = anyio.run(call, deployment.server, "alice", "send_email", {**EMAIL, "idempotency_key": "m-1"})
    assert not again.is_error, again.content
    anyio.run(call, deployment.server, "alice", "send_email", {**EMAIL, "idempotency_key": "m-1"})
    assert deployment.count("emails") == 1


def test_an_agent_cannot_resolve_its_own_unknown_outcome(deployment: Deployment) -> None:
    ticket = {"title": "refund me", "idempotency_key": "t-1"}
    first = anyio.run(call, deployment.server, "alice", "create_ticket", ticket)
    assert error_code(first) == "operation_outcome_unknown"
    unknown = operation_id(first)

    def try_to_resolve(client: httpx2.Client) -> list[int]:
        page = client.get(f"/operations/{unknown}", headers=AGENT)
        csrf = csrf_of(page.text) if page.status_code == 200 else "none: the page was refused"
        form = {"csrf_token": csrf, "finding": "failed", "reason": "it did not happen"}
        post = client.post(f"/operations/{unknown}/resolve", data=form, headers=AGENT)
        return [page.status_code, post.status_code]

    assert deployment.in_console(try_to_resolve) == [403, 403]
    retry = anyio.run(call, deployment.server, "alice", "create_ticket", ticket)
    assert error_code(retry) == "operation_outcome_unknown"
    assert deployment.count("tickets") == 1


def test_metrics_labels_carry_no_session_key_or_argument(deployment: Deployment) -> None:
    for tool in ("charge_card", "charge_session"):
        charge = {"card": "4242", "amount_cents": 950, "description": ARGUMENT, "idempotency_key": KEY + tool}
        assert not anyio.run(call, deployment.server, "alice", tool, charge, SESSION).is_error
    text = httpx2.get(deployment.server.base + "/metrics", headers=OPERATOR).text
    for secret in (SESSION, KEY, ARGUMENT, "scope="):
        assert secret not in text
    assert 'commitgate_budget_spent{budget="spend",principal="alice"} 950.0' in text
    assert 'commitgate_budget_sessions_near_limit{budget="per_session"} 1.0' in text
    assert 'commitgate_budget_limit{budget="per_session"} 1000.0' in text


def test_metrics_show_an_operator_only_the_spending_of_its_principals(deployment: Deployment) -> None:
    for who, amount in (("alice", 120), ("bob", 340)):
        charge = {"card": "4242", "amount_cents": amount, "idempotency_key": f"seen-{who}"}
        assert not anyio.run(call, deployment.server, who, "charge_card", charge).is_error
    base = deployment.server.base + "/metrics"
    carol = httpx2.get(base, headers=OPERATOR).text  # sees alice only, as on the console
    dave = httpx2.get(base, headers={"Authorization": f"Bearer {EVERY_PRINCIPAL_TOKEN}"}).text
    assert 'commitgate_budget_spent{budget="spend",principal="alice"}' in carol
    assert 'principal="bob"' not in carol
    assert 'commitgate_budget_spent{budget="spend",principal="bob"} 340.0' in dave
    assert 'principal="alice"' in dave


def test_a_console_bound_elsewhere_without_an_operator_token_names_the_key_to_add(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agents_only = tmp_path / "policy.toml"
    agents_only.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "l.db"}"\n' + token_entry("alice", "x" * 20)
    )
    (tmp_path / "l.db").touch()
    assert main(["console", "--policy", str(agents_only), "--host", "0.0.0.0", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "without an operator's token" in err and 'role = "operator"' in err and "[[auth.tokens]]" in err
