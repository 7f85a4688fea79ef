"""A decision taken with `commitgate ops approve|deny|resolve` names an operator, never an agent.

With operator tokens in the policy, `--by` (default: the OS user) must be one of their
principals, and one that sees the operation's principal; without any, any name but an agent's
principal. Each refusal leaves the operation as it was: the effect count says nothing ran.
The boundary holds the call on a real SQLite ledger; the commands run as the CLI runs them.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import textwrap
from pathlib import Path

import anyio.to_thread
import pytest
from support.boundary import ScriptedTool, SystemOfRecord, call_request, guarded, make_boundary
from support.policy import Run, run

from commitgate.server.core.boundary import CommitBoundary
from commitgate.server.core.requests import GuardedTool
from commitgate.server.core.resolutions import local_operator
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.facts import ErrorCode, State

AGENT = "agent-bot"


def token(role: str, principal: str, extra: str = "") -> str:
    digest = hashlib.sha256(f"{role}-{principal}-secret".encode()).hexdigest()
    return (
        f'[[auth.tokens]]\nprincipal = "{principal}"\nrole = "{role}"\ntoken_sha256 = "{digest}"\n{extra}\n'
    )


def policy_file(tmp_path: Path, *tokens: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(
        textwrap.dedent("""
            [tools.refund]
            class = "key-required"
            python = "tests:refund"
            """)
        + "\n".join(tokens),
        encoding="utf-8",
    )
    return path


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Run:
    return await anyio.to_thread.run_sync(run, capsys, list(argv))


async def held(
    tmp_path: Path, script: list[str], **approval: object
) -> tuple[CommitBoundary, GuardedTool, SystemOfRecord]:
    record = SystemOfRecord(tmp_path / "effects.db")
    ledger = await SQLiteLedger.open(tmp_path / "ledger.db")
    tool = guarded("refund", "key-required", ScriptedTool(record, script), **approval)
    return make_boundary(ledger, [tool]), tool, record


@pytest.mark.anyio
async def test_with_operator_tokens_only_an_operator_who_sees_the_principal_may_approve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = policy_file(
        tmp_path,
        token("agent", AGENT),
        token("agent", "other-bot"),
        token("operator", "alice", f'principals = ["{AGENT}"]'),
        token("operator", "bob", 'principals = ["other-bot"]'),
    )
    boundary, tool, record = await held(tmp_path, [], approval={"when": "true", "timeout": "1h"})
    try:
        pending = await boundary.call(call_request(tool, "k1", principal=AGENT))
        assert pending.operation is not None and pending.operation.state is State.AWAITING_APPROVAL
        op_id = pending.operation.operation_id
        where = ("--policy", str(policy), "--ledger", f"sqlite:///{tmp_path / 'ledger.db'}")
        as_agent = await cli(capsys, "ops", "approve", op_id, "--by", AGENT, *where)
        assert as_agent.code == 1 and "is not an operator" in as_agent.err and "alice, bob" in as_agent.err
        if local_operator() not in ("alice", "bob"):
            as_os_user = await cli(capsys, "ops", "approve", op_id, *where)
            assert as_os_user.code == 1 and "the OS user" in as_os_user.err, as_os_user.err
        other = await cli(capsys, "ops", "deny", op_id, "--by", "bob", "--reason", "no", *where)
        assert other.code == 1 and f"does not decide for principal {AGENT!r}" in other.err
        still = await boundary.call(call_request(tool, "k1", principal=AGENT))
        assert still.error is not None and still.error.code is ErrorCode.APPROVAL_PENDING
        assert record.count() == 0
        done = await cli(capsys, "ops", "approve", op_id, "--by", "alice", "--json", *where)
        assert done.code == 0, done.err
        assert json.loads(done.out)["approval"]["by"] == "alice"
        ran = await boundary.call(call_request(tool, "k1", principal=AGENT))
        assert ran.error is None and record.count() == 1
    finally:
        await boundary.ledger.close()


@pytest.mark.anyio
async def test_an_unknown_outcome_is_not_resolved_in_an_agents_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = policy_file(tmp_path, token("agent", AGENT))  # no operator tokens: local use
    boundary, tool, record = await held(tmp_path, ["ambiguous_after"])
    try:
        lost = await boundary.call(call_request(tool, "k1", principal=AGENT))
        assert lost.operation is not None and lost.operation.state is State.UNKNOWN
        op_id = lost.operation.operation_id
        where = ("--policy", str(policy), "--ledger", f"sqlite:///{tmp_path / 'ledger.db'}")
        resolve = ("ops", "resolve", op_id, "--failed", "--retryable", "--reason", "not found")
        as_agent = await cli(capsys, *resolve, "--by", AGENT, *where)
        assert as_agent.code == 1 and "is an agent's principal" in as_agent.err, as_agent.err
        retry = await boundary.call(call_request(tool, "k1", principal=AGENT))
        assert retry.error is not None and retry.error.code is ErrorCode.OPERATION_OUTCOME_UNKNOWN
        assert record.count() == 1  # the refused resolution let nothing run again
        found = ("ops", "resolve", op_id, "--succeeded", "--result", '{"ok": true}')
        done = await cli(capsys, *found, "--by", "anna", *where)
        assert done.code == 0 and "(by anna)" in done.out, done.err
        replay = await boundary.call(call_request(tool, "k1", principal=AGENT))
        assert replay.error is None and replay.replayed and record.count() == 1
    finally:
        await boundary.ledger.close()


@pytest.mark.anyio
async def test_on_stdio_the_os_user_is_the_agent_and_cannot_approve_its_own_call(tmp_path: Path) -> None:
    """No [server] principal: the stdio agent is the OS user, who is also `--by`'s default. Real
    processes: `commitgate serve` over stdio, `commitgate ops approve` with and without a policy."""
    import subprocess

    from support.wrapping import CONSOLE_SCRIPT, error_code, operation, serve

    ledger, sandbox = tmp_path / "ledger.db", tmp_path / "sandbox.db"
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[ledger]\nurl = "sqlite:///{ledger}"\n\n[tools.send_email]\nclass = "key-required"\n'
        'python = "commitgate.server.demo.tools:send_email"\napproval = { via = ["operator"] }\n'
    )
    email = {"to": "a@example.com", "subject": "s", "body": "b", "idempotency_key": "mail-1"}

    def approve(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [str(CONSOLE_SCRIPT), "ops", "approve", op_id, "--ledger", f"sqlite:///{ledger}", *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    async with serve(policy, tmp_path / "stderr.log", {"COMMITGATE_SANDBOX": str(sandbox)}) as client:
        pending = await client.call_tool("send_email", email)
        assert error_code(pending) == "approval_pending"
        op_id = str(pending.structured_content["error"]["operation"]["operation_id"])
        me = local_operator()
        unnamed = await anyio.to_thread.run_sync(approve)
        assert (
            unnamed.returncode == 1 and f"the OS user {me!r} is the principal of the agent" in unnamed.stderr
        )
        assert "Pass --by YOUR_NAME" in unnamed.stderr and "Traceback" not in unnamed.stderr
        named = await anyio.to_thread.run_sync(approve, "--by", me, "--policy", str(policy))
        assert named.returncode == 1 and f"--by {me!r} is the principal" in named.stderr, named.stderr
        still = await client.call_tool("send_email", email)
        assert error_code(still) == "approval_pending"
        person = await anyio.to_thread.run_sync(approve, "--by", f"{me}-in-person")
        assert person.returncode == 0, person.stderr
        ran = await client.call_tool("send_email", email)
        assert error_code(ran) is None and operation(ran)["attempts"] == 1
    with sqlite3.connect(sandbox) as conn:
        assert conn.execute("SELECT COUNT(*) FROM emails").fetchone()[0] == 1
