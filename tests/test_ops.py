"""Operating the ledger: `ops list|show|resolve|purge` and `stats`, against a real gateway and ledger file.

Operations are made by calling tools through the gateway (the same object the
MCP surface serves); effects are counted in the demo sandbox. An `UNKNOWN`
operation comes from a lost acknowledgement: the email is sent, the answer
lost, so commitgate cannot tell and records `UNKNOWN`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
from mcp.types import CallToolResult
from support.policy import Run, run

from commitgate.server.demo import tools as demo
from commitgate.server.ledger.base import ClaimRequest, this_owner
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.events import BoundaryEvent, Event
from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.model.outcomes import Verdict
from commitgate.server.policy.loading import load_policy
from commitgate.server.serve.gateway import Gateway

pytestmark = pytest.mark.anyio

POLICY = """
[server]
principal = "agent"

[ledger]
url = "sqlite:///{ledger}"

[tools.send_email]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
retry = {{ attempts = 1 }}

[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"
retention = "1ms"

[tools.reserve]
class = "compensable"
python = "commitgate.server.demo.tools:reserve"
compensate = {{ tool = "release", arguments = {{ booking_id = "{{result.booking_id}}" }} }}

[tools.release]
class = "key-required"
python = "commitgate.server.demo.tools:release"
expose = false
"""

EMAIL = {"to": "ann@example.com", "subject": "Your receipt", "body": "Thanks"}


@pytest.fixture
def policy_file(tmp_path: Path, sandbox: Path) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY.format(ledger=tmp_path / "ledger.db"))
    return path


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@asynccontextmanager
async def gateway(policy_file: Path) -> AsyncIterator[Gateway]:
    gw = await Gateway.open(load_policy(policy_file), policy_file)
    try:
        yield gw
    finally:
        await gw.close()


async def call(gw: Gateway, tool: str, key: str, session: str = "s1", **arguments: Any) -> CallToolResult:
    meta = {"commitgate/session": session}
    return await gw.call_tool(tool, {**arguments, "idempotency_key": key}, meta, None)


def error_code(result: CallToolResult) -> str | None:
    return (result.structured_content or {}).get("error", {}).get("code") if result.is_error else None


async def cli(capsys: pytest.CaptureFixture[str], command: list[str]) -> Run:
    """Run a command as the CLI does (it runs its own event loop, so: in a thread)."""
    return await anyio.to_thread.run_sync(run, capsys, command)


async def unknown_email(gw: Gateway, monkeypatch: pytest.MonkeyPatch, key: str = "receipt-1") -> str:
    """Send an email whose acknowledgement is lost: applied once, recorded UNKNOWN. Its operation id."""
    monkeypatch.setenv("COMMITGATE_SANDBOX_FAULTS", "send_email.lose_ack=1x")
    result = await call(gw, "send_email", key, **EMAIL)
    assert error_code(result) == "operation_outcome_unknown"
    assert demo.count("emails") == 1
    return str(result.structured_content["error"]["operation"]["operation_id"])


async def test_resolve_unknown_as_succeeded_then_a_retry_replays_it(
    policy_file: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with gateway(policy_file) as gw:
        op_id = await unknown_email(gw, monkeypatch)
        still = await call(gw, "send_email", "receipt-1", **EMAIL)
        assert error_code(still) == "operation_outcome_unknown"  # never re-run blindly

        listed = await cli(capsys, ["ops", "list", "--ledger", ledger_url, "--state", "unknown", "--json"])
        assert [op["operation_id"] for op in json.loads(listed.out)["operations"]] == [op_id]

        found = json.dumps({"message_id": "msg_from_outbox", "to": EMAIL["to"]})
        resolved = await cli(
            capsys,
            [
                *("ops", "resolve", op_id, "--ledger", ledger_url, "--succeeded", "--result", found),
                *("--reason", "the message is in the outbox", "--by", "alice"),
            ],
        )
        assert resolved.code == 0, resolved.text
        assert f"{op_id}: UNKNOWN -> SUCCEEDED (by alice)" in resolved.out

        replay = await call(gw, "send_email", "receipt-1", **EMAIL)
        assert not replay.is_error
        assert replay.structured_content == {"message_id": "msg_from_outbox", "to": EMAIL["to"]}
        meta = (replay.meta or {})["commitgate/operation"]
        assert meta["replayed"] is True and meta["state"] == "SUCCEEDED"
        assert demo.count("emails") == 1  # nothing re-ran

        status = await gw.call_tool("get_operation_status", {"operation_id": op_id}, None, None)
        operation = status.structured_content["operation"]
        assert operation["retry_advice"] == "done"
        assert operation["reconciliation"]["operator"] == "alice"

    shown = await cli(capsys, ["ops", "show", op_id, "--ledger", ledger_url, "--json"])
    history = json.loads(shown.out)["history"]
    assert [h["event"] for h in history] == ["claimed", "ambiguous", "resolved"]
    assert history[-1]["actor"] == "alice"
    assert history[-1]["detail"] == {"resolution": "succeeded", "reason": "the message is in the outbox"}
    assert json.loads(shown.out)["arguments"] == EMAIL


async def test_resolve_as_failed_replays_the_failure_and_retryable_runs_again(
    policy_file: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with gateway(policy_file) as gw:
        final = await unknown_email(gw, monkeypatch, "receipt-final")
        done = await cli(
            capsys,
            [
                "ops",
                "resolve",
                final,
                "--ledger",
                ledger_url,
                "--failed",
                "--reason",
                "bounced",
                "--by",
                "bo",
            ],
        )
        assert done.code == 0, done.text
        replay = await call(gw, "send_email", "receipt-final", **EMAIL)
        assert error_code(replay) == "operation_failed"
        assert "bounced (resolved by bo)" in replay.structured_content["error"]["message"]
        assert demo.count("emails") == 1

        monkeypatch.setenv(
            "COMMITGATE_SANDBOX_FAULTS", "send_email.lose_ack=2x"
        )  # a fresh budget: one more loss
        again = await call(gw, "send_email", "receipt-again", **EMAIL)
        assert error_code(again) == "operation_outcome_unknown"
        assert demo.count("emails") == 2
        retry_id = again.structured_content["error"]["operation"]["operation_id"]
        monkeypatch.delenv("COMMITGATE_SANDBOX_FAULTS")
        retryable = await cli(
            capsys,
            [
                *("ops", "resolve", retry_id, "--ledger", ledger_url, "--failed", "--retryable"),
                *("--reason", "the mail server has no trace of it"),
            ],
        )
        assert retryable.code == 0, retryable.text
        rerun = await call(gw, "send_email", "receipt-again", **EMAIL)
        assert not rerun.is_error
        assert (rerun.meta or {})["commitgate/operation"]["replayed"] is False
        assert demo.count("emails") == 3  # the operator said it never happened: it ran once more


async def test_resolve_refuses_what_it_should_not_touch(
    policy_file: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with gateway(policy_file) as gw:
        ok = await call(gw, "create_ticket", "t-1", title="printer")
        done_id = ok.meta["commitgate/operation"]["operation_id"]  # type: ignore[index]
        unknown_id = await unknown_email(gw, monkeypatch)
    cases = [
        ([done_id, "--succeeded"], f"{done_id} is SUCCEEDED: only UNKNOWN operations are resolved by hand"),
        (["op_nope", "--succeeded"], "no operation op_nope in the ledger"),
        ([unknown_id, "--failed"], "--failed needs --reason"),
        ([unknown_id, "--succeeded", "--result", "{not json"], "--result: the result is not valid JSON"),
        ([unknown_id, "--succeeded", "--retryable"], "--retryable goes with --failed"),
    ]
    for arguments, message in cases:
        result = await cli(capsys, ["ops", "resolve", *arguments, "--ledger", ledger_url])
        assert result.code == 1, arguments
        assert message in result.err
        assert "Traceback" not in result.text
    shown = await cli(capsys, ["ops", "show", unknown_id, "--ledger", ledger_url, "--json"])
    assert json.loads(shown.out)["state"] == "UNKNOWN"  # none of the refused attempts changed it


async def test_stats_exits_2_on_operations_unresolved_too_long(
    policy_file: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with gateway(policy_file) as gw:
        await call(gw, "create_ticket", "t-1", title="printer")
        op_id = await unknown_email(gw, monkeypatch)

    fresh = await cli(capsys, ["stats", "--ledger", ledger_url, "--unresolved-after", "15m"])
    assert fresh.code == 0, fresh.text
    assert "no operation unresolved for more than 15m" in fresh.out

    stale = await cli(capsys, ["stats", "--ledger", ledger_url, "--unresolved-after", "0s"])
    assert stale.code == 2
    assert op_id in stale.out and "ops resolve" in stale.out

    summary = await cli(capsys, ["stats", "--ledger", ledger_url, "--unresolved-after", "0s", "--json"])
    assert summary.code == 2
    data = json.loads(summary.out)
    assert data["operations"]["UNKNOWN"] == 1 and data["operations"]["SUCCEEDED"] == 1
    assert data["events"]["claimed"] == 2 and data["events"]["ambiguous"] == 1
    assert [op["operation_id"] for op in data["unresolved"]] == [op_id]

    await cli(capsys, ["ops", "resolve", op_id, "--ledger", ledger_url, "--succeeded"])
    after = await cli(capsys, ["stats", "--ledger", ledger_url, "--unresolved-after", "0s", "--json"])
    assert after.code == 0
    assert json.loads(after.out)["resolved_by_operator"] == 1
    plain = await cli(capsys, ["stats", "--ledger", ledger_url])
    assert plain.code == 0 and "SUCCEEDED" in plain.out and "resolved" in plain.out


async def test_an_orphaned_running_operation_counts_as_unknown(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process died mid-call: its RUNNING record is stale for `stats` and resolvable by hand."""
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    host = this_owner().split(":")[0]
    dead = f"{host}:{2**22 + 12345}:deadbeef"  # a pid that does not run on this host
    request = ClaimRequest(
        "agent", "s1", "k", "send_email", IdempotencyClass.KEY_REQUIRED, "f" * 64, "{}", dead, 60.0, 3600.0
    )
    claim = await ledger.claim(request, time.time())
    await ledger.close()
    stale = await cli(capsys, ["stats", "--ledger", ledger_url, "--unresolved-after", "0s", "--json"])
    assert stale.code == 2
    assert [op["lease_expired"] for op in json.loads(stale.out)["unresolved"]] == [True]
    resolved = await cli(
        capsys,
        [
            "ops",
            "resolve",
            claim.operation.operation_id,
            "--ledger",
            ledger_url,
            "--failed",
            "--reason",
            "no",
        ],
    )
    assert resolved.code == 0, resolved.text
    shown = await cli(capsys, ["ops", "show", claim.operation.operation_id, "--ledger", ledger_url, "--json"])
    events = [h["event"] for h in json.loads(shown.out)["history"]]
    assert events == ["claimed", "lease_expired", "resolved"]


async def test_list_filters_and_tables(
    policy_file: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with gateway(policy_file) as gw:
        await call(gw, "create_ticket", "t-1", session="s1", title="printer")
        await call(gw, "reserve", "r-1", session="s2", resource="room-1", customer="c1")
        unknown_id = await unknown_email(gw, monkeypatch)

    async def ids(*flags: str) -> list[str]:
        result = await cli(capsys, ["ops", "list", "--ledger", ledger_url, "--json", *flags])
        assert result.code == 0, result.text
        return [f"{op['tool']}:{op['session']}" for op in json.loads(result.out)["operations"]]

    assert await ids() == ["send_email:s1", "reserve:s2", "create_ticket:s1"]  # newest first
    assert await ids("--session", "s2") == ["reserve:s2"]
    assert await ids("--tool", "create_ticket") == ["create_ticket:s1"]
    assert await ids("--state", "SUCCEEDED", "--limit", "1") == ["reserve:s2"]
    assert await ids("--principal", "agent", "--session", "s1") == ["send_email:s1", "create_ticket:s1"]
    assert await ids("--principal", "someone-else") == []
    assert await ids("--older-than", "1h") == []

    table = await cli(capsys, ["ops", "list", "--ledger", ledger_url])
    assert unknown_id in table.out and "UNKNOWN" in table.out and "3 operation(s)" in table.out
    shown = await cli(capsys, ["ops", "show", unknown_id, "--ledger", ledger_url])
    assert "history" in shown.out and "ambiguous" in shown.out and "ann@example.com" in shown.out


async def test_purge_removes_expired_records_but_never_unknown(
    policy_file: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with gateway(policy_file) as gw:
        await call(gw, "create_ticket", "t-1", title="printer")  # retention 1ms: expired at once
        await call(gw, "reserve", "r-1", resource="room-1", customer="c1")  # retention 24h
        await unknown_email(gw, monkeypatch)
    purged = await cli(capsys, ["ops", "purge", "--ledger", ledger_url, "--json"])
    assert json.loads(purged.out) == {"purged": 1}
    left = await cli(capsys, ["ops", "list", "--ledger", ledger_url, "--json"])
    assert sorted(op["state"] for op in json.loads(left.out)["operations"]) == ["SUCCEEDED", "UNKNOWN"]
    again = await cli(capsys, ["ops", "purge", "--ledger", ledger_url])
    assert "purged 0 expired operation(s)" in again.out
    assert demo.count("tickets") == 1  # purging forgets records, never effects


async def test_the_ledger_comes_from_the_policy_and_is_never_created(
    policy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "elsewhere" / "ledger.db"
    listed = await cli(capsys, ["ops", "list", "--ledger", f"sqlite:///{missing}"])
    assert listed.code == 1 and "no ledger at" in listed.err  # said, not mistaken for an empty ledger
    shown = await cli(capsys, ["ops", "show", "op_x", "--ledger", f"sqlite:///{missing}"])
    assert shown.code == 1 and "no ledger at" in shown.err
    stats = await cli(capsys, ["stats", "--ledger", f"sqlite:///{missing}", "--unresolved-after", "0s"])
    assert stats.code == 1 and "no ledger at" in stats.err
    assert not missing.exists()

    async with gateway(policy_file) as gw:
        await call(gw, "create_ticket", "t-1", title="printer")
    via_policy = await cli(capsys, ["ops", "list", "--policy", str(policy_file), "--json"])
    assert [op["tool"] for op in json.loads(via_policy.out)["operations"]] == ["create_ticket"]
    bad = await cli(capsys, ["ops", "list", "--ledger", "mysql://x/y"])
    assert bad.code == 1 and "unsupported ledger URL" in bad.err


async def test_stats_through_the_console_script(
    policy_file: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = Path(sys.executable).parent / "commitgate"
    async with gateway(policy_file) as gw:
        op_id = await unknown_email(gw, monkeypatch)
    done = subprocess.run(
        [str(script), "stats", "--ledger", ledger_url, "--unresolved-after", "0s"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert op_id in done.stdout


async def test_stats_adds_what_only_a_running_server_counts(
    ledger_url: str, policy_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replays and conflicts are not in the ledger: `stats --metrics` reads them from `/metrics`."""
    import http.server
    import threading

    from prometheus_client import generate_latest

    from commitgate.server.serve.metrics import Metrics

    metrics = Metrics()
    for event in (Event.REPLAY, Event.REPLAY, Event.CONFLICT, Event.RETRY):
        metrics(BoundaryEvent(event, "send_email", IdempotencyClass.KEY_REQUIRED))
    metrics(
        BoundaryEvent(
            Event.RECONCILIATION, "charge_card", IdempotencyClass.KEY_AND_STATUS_CHECK, verdict=Verdict.FOUND
        )
    )
    body = generate_latest(metrics.registry)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.headers.get("Authorization") == "Bearer s3cret"
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body if ok else b"")

        def log_message(self, format: str, *args: Any) -> None:
            return None

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    try:
        async with gateway(policy_file) as gw:
            await call(gw, "create_ticket", "t-1", title="printer")
        monkeypatch.setenv("CG_TEST_METRICS_TOKEN", "s3cret")
        flags = ["--ledger", ledger_url, "--metrics", url, "--token-env", "CG_TEST_METRICS_TOKEN"]
        result = await cli(capsys, ["stats", *flags, "--json"])
        assert result.code == 0, result.text
        server = json.loads(result.out)["since_server_start"]
        assert (server["replays"], server["conflicts"], server["retries"], server["reconciliations"]) == (
            2,
            1,
            1,
            1,
        )
        plain = await cli(capsys, ["stats", *flags])
        assert "since the server started: replays 2 · conflicts 1" in plain.out
        monkeypatch.setenv("CG_TEST_METRICS_TOKEN", "wrong")
        refused = await cli(capsys, ["stats", *flags])
        assert refused.code == 1 and "cannot read metrics" in refused.err and "401" in refused.err
    finally:
        httpd.shutdown()


async def test_show_masks_secrets_on_screen_and_keeps_them_in_json(
    tmp_path: Path, ledger_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A terminal is seen over shoulders and pasted into tickets: `ops show` hides credentials and
    cuts card numbers to their last four digits, as the console does; --json is for scripts."""
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    try:
        arguments = {"card": "4242 4242 4242 4242", "api_key": "sk_live_abc", "amount_cents": 500}
        claim = await ledger.claim(
            ClaimRequest(
                principal="agent",
                session="s1",
                step="pay-1",
                tool="charge_card",
                idempotency_class=IdempotencyClass.KEY_REQUIRED,
                fingerprint="fp",
                arguments_json=json.dumps(arguments),
                owner=this_owner(),
                lease_seconds=30.0,
                retention_seconds=3600.0,
            ),
            time.time(),
        )
    finally:
        await ledger.close()
    op_id = claim.operation.operation_id
    shown = await cli(capsys, ["ops", "show", op_id, "--ledger", ledger_url])
    assert shown.code == 0, shown.text
    assert "4242 4242 4242 4242" not in shown.out and "sk_live_abc" not in shown.out
    assert "•••• 4242" in shown.out and "500" in shown.out
    raw = await cli(capsys, ["ops", "show", op_id, "--ledger", ledger_url, "--json"])
    assert json.loads(raw.out)["arguments"] == arguments


SECRET_TOOL = '''
def issue_key(name: str) -> dict:
    """Issue an API key (its result carries the credential)."""
    return {"name": name, "api_key": "sk_live_s3cr3t_f0r_" + name}
'''


async def test_show_masks_a_credential_in_the_text_block_as_in_structured_content(tmp_path: Path) -> None:
    """A tool's text block repeats its structured result: `ops show` hides the credential in both."""
    from support.wrapping import CONSOLE_SCRIPT, operation, serve

    (tmp_path / "secret_tools.py").write_text(SECRET_TOOL)
    policy, ledger = tmp_path / "policy.toml", tmp_path / "ledger.db"
    policy.write_text(
        f'[ledger]\nurl = "sqlite:///{ledger}"\n\n'
        '[tools.issue_key]\nclass = "key-required"\npython = "secret_tools:issue_key"\n'
    )
    async with serve(policy, tmp_path / "stderr.log") as client:
        issued = await client.call_tool("issue_key", {"name": "ann", "idempotency_key": "key-1"})
    secret = "sk_live_s3cr3t_f0r_ann"
    assert secret in json.dumps([block.model_dump() for block in issued.content])  # the text block has it
    op_id = operation(issued)["operation_id"]
    shown = subprocess.run(
        [str(CONSOLE_SCRIPT), "ops", "show", op_id, "--ledger", f"sqlite:///{ledger}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert shown.returncode == 0, shown.stderr
    assert secret not in shown.stdout and "***" in shown.stdout, shown.stdout
    assert '\\"name\\": \\"ann\\"' in shown.stdout or '"name": "ann"' in shown.stdout  # the rest is shown
