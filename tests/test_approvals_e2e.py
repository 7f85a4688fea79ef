"""Approvals end to end: real `commitgate serve` processes over stdio, emails counted in the sandbox.

A call that needs approval executes nothing until a person decides: an operator with
`commitgate ops approve|deny` (outside the server's process, on the same ledger), or the client's user,
asked with an elicitation during the call (handshake era) or with an InputRequiredResult
(protocol 2026-07-28). Approved: exactly one email however many retries race; denied or
expired: none.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import types
from mcp.client.session import ElicitationFnT
from support.e2e import (
    SESSION_META,
    TOOLS_TOML,
    Deployment,
    Server,
    as_meta,
    error,
    error_code,
    operation,
    policy_toml,
    serve,
    together,
)

from commitgate.client import ApprovalDenied, Backoff, Gate
from commitgate.server.cli.main import main
from commitgate.server.ledger import open_ledger
from commitgate.server.serve.asking import INPUT_KEY

pytestmark = pytest.mark.slow

TOOLS = """
[tools.send_email]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
timeout = "10s"
approval = { when = "!arguments.to.endsWith('@example.com')", timeout = "1h", prompt = "Send '{arguments.subject}' to {arguments.to}?" }

[tools.send_later]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
approval = { timeout = "1s", via = ["operator"] }
"""

OUTSIDE = {"to": "someone@elsewhere.org", "subject": "Quarterly numbers", "body": "attached"}
# How long a call waits for its own effect, or for another caller's, before answering
# operation_in_progress. No test here is about that answer: each waits for the call's real outcome,
# which a loaded machine can take well over a second to record (sandbox and ledger both fsync).
WAIT = "20s"


def deployment(root: Path) -> Deployment:
    made = Deployment.create(root)
    waits = policy_toml(respond_within=WAIT, in_progress_wait=WAIT)
    made.policy.write_text(waits.replace(TOOLS_TOML, TOOLS), encoding="utf-8")
    return made


@pytest.fixture(scope="module")
async def operators(tmp_path_factory: pytest.TempPathFactory, anyio_backend: str) -> AsyncIterator[Server]:
    """One server for the tests in which only an operator decides (its client cannot be asked):
    each runs in a session of its own and counts only the emails of that session."""
    async with serve(deployment(tmp_path_factory.mktemp("operators"))) as server:
        yield server


def email(key: str, **changes: Any) -> dict[str, Any]:
    return {**OUTSIDE, "idempotency_key": key, **changes}


def emails(d: Deployment, session: str | None = None) -> int:
    """Emails sent (by the calls of `session` when given)."""
    return d.count("emails", session=session) if session is not None else d.count("emails")


async def ops(d: Deployment, *args: str, ledger: str | None = None) -> subprocess.CompletedProcess[str]:
    """`commitgate ops ...` as an operator runs it, on the ledger the servers use (the deployment's file).

    The command's own entry point, run in this process (not the server's): its decision reaches the
    server only through the ledger, as an operator's does, without paying a Python start per command."""
    argv = ["ops", *args, "--ledger", ledger or f"sqlite:///{d.ledger}"]
    if args[0] in ("approve", "deny", "resolve") and "--by" not in args:
        argv += ["--by", "ops-on-call"]  # the servers' agent is the OS user: an operator is someone else
    return await anyio.to_thread.run_sync(_command, argv)


def _command(argv: list[str]) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as refused:  # argparse refusing the arguments
            code = refused.code if isinstance(refused.code, int) else 2
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


async def awaiting_ids(d: Deployment, session: str) -> list[str]:
    listed = await ops(d, "list", "--state", "AWAITING_APPROVAL", "--session", session, "--json")
    assert listed.returncode == 0, listed.stderr
    return [op["operation_id"] for op in json.loads(listed.stdout)["operations"]]


async def state_in_ledger(d: Deployment, operation_id: str) -> str:
    """The state recorded for the operation, read from the ledger file without touching it."""
    ledger = await open_ledger(f"sqlite:///{d.ledger}", read_only=True)
    try:
        op = await ledger.get_by_id(None, operation_id)
    finally:
        await ledger.close()
    assert op is not None, operation_id
    return op.state.value


# --- an operator decides ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_approved_from_the_cli_then_eight_racing_retries_send_exactly_one_email(
    operators: Server,
) -> None:
    server, d, run = operators, operators.deployment, "approved-by-cli"
    inside = await server.call("send_email", email("mail-inside", to="team@example.com"), session=run)
    assert not inside.is_error and emails(d, run) == 1  # `when` is false: no approval needed
    first = await server.call("send_email", email("mail-1"), session=run)
    assert error_code(first) == "approval_pending", first.content
    op_id = operation(first)["operation_id"]
    assert operation(first)["state"] == "AWAITING_APPROVAL" and operation(first)["attempts"] == 0
    status = (await server.status(run, idempotency_key="mail-1"))["operation"]
    assert status["retry_advice"] == "wait_and_poll" and status["approval"]["state"] == "awaiting"
    assert error_code(await server.call("send_email", email("mail-1"), session=run)) == "approval_pending"
    assert error_code(await server.call("send_email", email("mail-1", subject="other"), session=run)) == (
        "idempotency_key_reused"
    )
    assert emails(d, run) == 1

    assert await awaiting_ids(d, run) == [op_id]
    approved = await ops(d, "approve", op_id, "--reason", "checked with finance", "--by", "anna")
    assert approved.returncode == 0, approved.stderr
    assert "AWAITING_APPROVAL -> PENDING (by anna)" in approved.stdout
    again = await ops(d, "approve", op_id)
    assert again.returncode == 1 and "already approved by anna" in again.stderr
    status = (await server.status(run, idempotency_key="mail-1"))["operation"]
    assert status["retry_advice"] == "safe_to_retry_same_key"
    assert {k: status["approval"][k] for k in ("state", "by", "via", "reason")} == {
        "state": "approved", "by": "anna", "via": "operator", "reason": "checked with finance",
    }  # fmt: skip

    results: list[types.CallToolResult] = []

    async def retry() -> None:
        results.append(await server.call("send_email", email("mail-1"), session=run))

    async with anyio.create_task_group() as group:
        for _ in range(8):
            group.start_soon(retry)
    assert [r.is_error for r in results] == [False] * 8, [r.content for r in results if r.is_error]
    assert emails(d, run) == 2 and d.count("emails", session=run, to_addr=OUTSIDE["to"]) == 1
    assert len({r.structured_content["message_id"] for r in results if r.structured_content}) == 1
    shown = await ops(d, "show", op_id, "--json")
    assert shown.returncode == 0 and "approved" in shown.stdout and "anna" in shown.stdout


@pytest.mark.anyio
async def test_denied_from_the_cli_never_sends_and_says_why(operators: Server) -> None:
    server, d, run = operators, operators.deployment, "denied-by-cli"
    first = await server.call("send_email", email("mail-d"), session=run)
    op_id = operation(first)["operation_id"]
    no_reason = await ops(d, "deny", op_id)
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    denied = await ops(d, "deny", op_id, "--reason", "not to outside addresses")
    assert denied.returncode == 0, denied.stderr
    answer = await server.call("send_email", email("mail-d"), session=run)
    assert error_code(answer) == "approval_denied"
    assert "not to outside addresses" in error(answer)["message"]
    status = (await server.status(run, idempotency_key="mail-d"))["operation"]
    assert status["state"] == "FAILED_FINAL" and status["retry_advice"] == "do_not_retry"
    late = await ops(d, "approve", op_id)
    assert late.returncode == 1 and "already denied" in late.stderr
    running = await ops(d, "approve", "op_doesnotexist")
    assert running.returncode == 1 and "no operation" in running.stderr
    assert emails(d, run) == 0


@pytest.mark.anyio
async def test_not_decided_in_time_expires_and_never_sends(operators: Server) -> None:
    server, d, run = operators, operators.deployment, "never-decided"
    first = await server.call("send_later", email("mail-e"), session=run)
    assert error_code(first) == "approval_pending"
    op_id = operation(first)["operation_id"]
    # Past its 1 s timeout, the server's sweep (every lease / 2 = 1 s) expires it with nobody touching
    # it: watched in the ledger file, since a status call would expire it itself.
    with anyio.fail_after(15):
        while await state_in_ledger(d, op_id) == "AWAITING_APPROVAL":
            await anyio.sleep(0.1)
    shown = await ops(d, "show", op_id, "--json")
    assert shown.returncode == 0 and '"FAILED_FINAL"' in shown.stdout, shown.stdout
    answer = await server.call("send_later", email("mail-e"), session=run)
    assert error_code(answer) == "approval_expired"
    refused = await ops(d, "approve", op_id)
    assert refused.returncode == 1 and "not awaiting approval" in refused.stderr
    assert emails(d, run) == 0


# --- the client's user decides -----------------------------------------------------------------------


@dataclass
class Person:
    """The client's user: answers each question with `action` (and `reason`), noting the questions."""

    action: str = "cancel"
    reason: str | None = None
    asked: list[str] = field(default_factory=list)

    def will(self, action: str, reason: str | None = None) -> list[str]:
        """From now on answer `action`; the questions asked from now on."""
        self.action, self.reason, self.asked = action, reason, []
        return self.asked

    async def __call__(self, context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        self.asked.append(params.message)
        content = {"reason": self.reason} if self.reason and self.action == "accept" else None
        return types.ElicitResult(action=self.action, content=content)


def person(action: str, asked: list[str], reason: str | None = None) -> ElicitationFnT:
    return Person(action, reason, asked)


@dataclass
class Asking:
    server: Server
    person: Person
    mode: str

    def session(self, test: str) -> str:
        return f"{test}-{self.mode}"


@pytest.fixture(
    scope="module", params=["legacy", "auto"]
)  # handshake era (elicitation/create), 2026-07-28 (MRTR)
async def asking(
    request: pytest.FixtureRequest, operators: Server, anyio_backend: str
) -> AsyncIterator[Asking]:
    """A server on the shared ledger whose client asks its user, per protocol era: each test says
    what the user answers and runs in a session of its own."""
    user = Person()
    async with serve(operators.deployment, mode=request.param, elicitation_callback=user) as server:
        yield Asking(server, user, request.param)


@pytest.mark.anyio
async def test_the_clients_user_accepts_and_it_runs_once(asking: Asking) -> None:
    server, d, run = asking.server, asking.server.deployment, asking.session("accepts")
    asked = asking.person.will("accept", "looks right")
    answer = await server.call("send_email", email("mail-a"), session=run)
    assert not answer.is_error, answer.content
    replay = await server.call("send_email", email("mail-a"), session=run)
    assert operation(replay)["replayed"] is True
    status = (await server.status(run, idempotency_key="mail-a"))["operation"]
    assert emails(d, run) == 1
    assert status["approval"]["via"] == "client" and status["approval"]["reason"] == "looks right"
    (question,) = asked
    assert "Send 'Quarterly numbers' to someone@elsewhere.org?" in question
    assert "send_email" in question and "Requested by:" in question


@pytest.mark.anyio
async def test_the_clients_user_declines_and_nothing_runs(asking: Asking) -> None:
    server, d, run = asking.server, asking.server.deployment, asking.session("declines")
    asking.person.will("decline")
    answer = await server.call("send_email", email("mail-n"), session=run)
    assert error_code(answer) == "approval_denied", answer.content
    assert "declined by the client's user" in error(answer)["message"]
    assert error_code(await server.call("send_email", email("mail-n"), session=run)) == "approval_denied"
    assert emails(d, run) == 0


@pytest.mark.anyio
async def test_a_cancelled_question_stays_pending_for_an_operator(asking: Asking, operators: Server) -> None:
    server, d, run = asking.server, asking.server.deployment, asking.session("cancelled")
    asking.person.will("cancel")
    answer = await server.call("send_email", email("mail-c"), session=run)
    assert error_code(answer) == "approval_pending", answer.content
    assert emails(d, run) == 0
    assert (await ops(d, "approve", operation(answer)["operation_id"])).returncode == 0
    # Another server on the same ledger, whose client cannot be asked: the approved call runs.
    assert not (await operators.call("send_email", email("mail-c"), session=run)).is_error
    assert emails(d, run) == 1


@pytest.mark.anyio
async def test_a_held_call_wakes_up_when_an_operator_approves(tmp_path: Path) -> None:
    d = deployment(tmp_path)  # the question stays open up to respond_within (WAIT): the operator is sooner
    asked = anyio.Event()

    async def slow_person(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.set()
        await anyio.sleep(30)  # the person never answers; an operator decides meanwhile
        return types.ElicitResult(action="cancel")

    async with serve(d, mode="legacy", elicitation_callback=slow_person) as server:
        answers: list[types.CallToolResult] = []

        async def call() -> None:
            answers.append(await server.call("send_email", email("mail-h")))

        async with anyio.create_task_group() as group:
            group.start_soon(call)
            with anyio.fail_after(10):
                await asked.wait()
            status = (await server.status(None, idempotency_key="mail-h"))["operation"]
            assert (await ops(d, "approve", status["operation_id"])).returncode == 0
    (answer,) = answers
    assert not answer.is_error, answer.content
    assert operation(answer)["replayed"] is False and emails(d) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_client_without_elicitation_gets_approval_pending_at_once(tmp_path: Path, mode: str) -> None:
    d = deployment(tmp_path)  # respond_within (WAIT) is far beyond the 5 s the answer may take
    async with serve(d, mode=mode) as server:
        with anyio.fail_after(5):
            answer = await server.call("send_email", email("mail-x"))
    assert error_code(answer) == "approval_pending"
    assert "needs a person's approval" in error(answer)["message"]
    assert emails(d) == 0


KEY = "k" * 40  # a shared request-state key: every replica can open the state another one sealed


@pytest.mark.anyio
async def test_the_second_round_may_reach_another_replica_and_is_checked_against_the_ledger(
    tmp_path: Path,
) -> None:
    d = deployment(tmp_path)
    shared = {"COMMITGATE_REQUEST_STATE_KEYS": KEY}
    asked: list[str] = []
    callback = person("accept", asked)
    async with together(serve(d, env=shared, elicitation_callback=callback), serve(d, env=shared)) as (a, b):
        arguments = email("mail-r")
        first = await a.client.session.call_tool(
            "send_email", arguments, meta=as_meta({SESSION_META: "run-1"}), allow_input_required=True
        )
        assert isinstance(first, types.InputRequiredResult) and first.input_requests
        assert first.request_state is not None and "op_" not in first.request_state  # sealed
        accept = {INPUT_KEY: types.ElicitResult(action="accept")}
        # the same state with the call moved to another session: not this call's operation
        moved = await b.client.session.call_tool(
            "send_email",
            arguments,
            meta=as_meta({SESSION_META: "run-2"}),
            input_responses=accept,  # type: ignore[arg-type]
            request_state=first.request_state,
        )
        assert error_code(moved) == "invalid_arguments" and "requestState" in error(moved)["message"]
        assert emails(d) == 0
        second = await b.client.session.call_tool(
            "send_email",
            arguments,
            meta=as_meta({SESSION_META: "run-1"}),
            input_responses=accept,  # type: ignore[arg-type]
            request_state=first.request_state,
        )
        assert not second.is_error, second.content
    assert emails(d) == 1


@pytest.mark.anyio
async def test_the_client_gate_waits_for_the_decision_then_runs_or_raises(operators: Server) -> None:
    server, d, run = operators, operators.deployment, "run-9"
    gate = Gate(server.client, session=run, backoff=Backoff(initial=0.05, maximum=0.2))
    done: list[Any] = []

    async def call() -> None:
        done.append(await gate.call("send_email", OUTSIDE, step="mail"))

    async with anyio.create_task_group() as group:
        group.start_soon(call)
        waiting = await server.wait_for_state(run, "mail", {"AWAITING_APPROVAL"})
        assert (await ops(d, "approve", waiting["operation_id"])).returncode == 0
    (result,) = done
    assert result.replayed is False and result.operation["state"] == "SUCCEEDED"

    async def deny_soon() -> None:
        waiting = await server.wait_for_state(run, "mail-2", {"AWAITING_APPROVAL"})
        assert (await ops(d, "deny", waiting["operation_id"], "--reason", "no")).returncode == 0

    async with anyio.create_task_group() as group:
        group.start_soon(deny_soon)
        with pytest.raises(ApprovalDenied) as denied:
            await gate.call("send_email", {**OUTSIDE, "subject": "again"}, step="mail-2")
    assert denied.value.code == "approval_denied"
    assert emails(d, run) == 1


@pytest.mark.anyio
async def test_a_suspected_duplicate_goes_to_the_clients_user_with_the_earlier_operation(
    tmp_path: Path,
) -> None:
    """The tool's `approval.via` lets the client's user decide, so a suspected duplicate goes there too
    (without an approval table only operators decide one: test_budget_takes_e2e.py)."""
    d = Deployment.create(tmp_path)
    tools = TOOLS_TOML.replace(
        'python = "commitgate.server.demo.tools:send_email"\n',
        'python = "commitgate.server.demo.tools:send_email"\nduplicates = { action = "approval" }\n'
        'approval = { when = "false", via = ["client", "operator"] }\n',
    )
    # Each call waits for its own outcome (WAIT): on a loaded machine the first email alone can take
    # longer than a tight respond_within, and the answer would be operation_in_progress.
    waits = policy_toml(respond_within=WAIT, in_progress_wait=WAIT)
    d.policy.write_text(waits.replace(TOOLS_TOML, tools), encoding="utf-8")
    asked: list[str] = []
    async with serve(d, elicitation_callback=person("accept", asked)) as server:
        first = await server.call("send_email", email("mail-1"))
        assert not first.is_error and not asked  # nothing like it before: it just runs
        second = await server.call("send_email", email("mail-2"))
        assert not second.is_error, second.content
    (question,) = asked
    assert f"Possible duplicate of {operation(first)['operation_id']}" in question
    assert emails(d) == 2


@pytest.mark.anyio
@pytest.mark.postgres
async def test_on_postgres_two_replicas_run_an_approved_call_exactly_once(tmp_path: Path) -> None:
    from support.postgres import fresh_url

    url = await fresh_url()
    d = deployment(tmp_path)
    async with together(serve(d, ledger=url), serve(d, ledger=url)) as (one, two):
        first = await one.call("send_email", email("mail-pg"))
        assert error_code(first) == "approval_pending"
        approve = await ops(d, "approve", operation(first)["operation_id"], ledger=url)
        assert approve.returncode == 0, approve.stderr
        results: list[types.CallToolResult] = []

        async def retry(server: Any) -> None:
            results.append(await server.call("send_email", email("mail-pg")))

        async with anyio.create_task_group() as group:
            for i in range(8):
                group.start_soon(retry, (one, two)[i % 2])
    assert [r.is_error for r in results] == [False] * 8, [r.content for r in results if r.is_error]
    assert sum(operation(r)["replayed"] is False for r in results) == 1
    assert emails(d) == 1


@pytest.mark.anyio
async def test_over_http_behind_a_round_robin_each_round_may_reach_another_replica(tmp_path: Path) -> None:
    """Streamable HTTP with bearer tokens, two replicas on one ledger, requests alternating between
    them: the client's answer comes back through the other replica and runs the call once."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from support.http_servers import RoundRobin, bearer, running_together, write_policy

    policy = write_policy(tmp_path)
    text = policy.read_text(encoding="utf-8").replace(
        'python = "commitgate.server.demo.tools:create_ticket"\n',
        'python = "commitgate.server.demo.tools:create_ticket"\napproval = { prompt = "Open {arguments.title}?" }\n',
    )
    policy.write_text(text, encoding="utf-8")
    where = {"ledger": tmp_path / "ledger.db", "sandbox": tmp_path / "sandbox.db"}
    shared = {"COMMITGATE_REQUEST_STATE_KEYS": KEY}
    asked: list[str] = []
    replica = {"workdir": tmp_path, "policy": policy, "transport": "streamable-http", "env": shared, **where}
    with running_together(replica, replica) as (a, b):
        balancer = RoundRobin([a.port, b.port])
        async with (
            httpx2.AsyncClient(headers=bearer("alice"), timeout=httpx2.Timeout(30, read=60), transport=balancer) as http,
            Client(streamable_http_client(a.endpoint, http_client=http), elicitation_callback=person("accept", asked)) as client,
        ):  # fmt: skip
            answer = await client.call_tool(
                "create_ticket", {"title": "refund desk", "idempotency_key": "t-1"}
            )
        assert not answer.is_error, answer.content
        assert len(set(balancer.sent)) == 2
    (question,) = asked
    assert "Open refund desk?" in question and "Requested by: alice" in question
    d = Deployment(tmp_path, policy, where["ledger"], where["sandbox"])
    assert d.count("tickets") == 1
