"""Approvals: the ledger on every backend, the commit boundary, the policy and the decisions.

A call that needs approval is recorded AWAITING_APPROVAL with no attempt and no effect; a
decision moves it (approved -> PENDING, denied / expired -> FAILED_FINAL) exactly once; an
approved operation runs exactly once however many calls race for it. Through real server
processes: test_approvals_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import textwrap
import time
from pathlib import Path

import anyio.to_thread
import pytest
from mcp.types import InputRequiredResult
from support.boundary import (
    FakeClock,
    ScriptedTool,
    SystemOfRecord,
    call_request,
    guarded,
    make_boundary,
)
from test_ledger_contract import OWNER, T0, request

from commitgate.server.bench.approvals import measure
from commitgate.server.core import approvals
from commitgate.server.core.approvals import ApprovalRefused
from commitgate.server.core.views import status_view
from commitgate.server.ledger.base import ClaimKind, ClaimRequest, DuplicateCheck, Lease, Ledger
from commitgate.server.model.facts import ErrorCode, IdempotencyClass, RetryAdvice, State
from commitgate.server.model.notes import ApprovalRecord
from commitgate.server.model.records import Operation
from commitgate.server.policy.loading import analyse_text, loads_policy
from commitgate.server.policy.problems import PolicyError
from commitgate.server.serve.metrics import Metrics
from commitgate.server.serve.registry import APPROVAL_SENTENCE, build_tools

WAIT = {"state": "awaiting", "deciders": ["client", "operator"], "requested_at": T0, "expires_at": T0 + 60}


def awaiting(step: str = "k1", **kw: object) -> ClaimRequest:
    return dataclasses.replace(request(step, **kw), approval=ApprovalRecord.from_stored(WAIT))  # type: ignore[arg-type]


async def waiting_op(ledger: Ledger, step: str = "k1", **kw: object) -> Operation:
    claim = await ledger.claim(awaiting(step, **kw), T0)
    assert claim.kind is ClaimKind.AWAITING, claim
    return claim.operation


# --- the ledger, every backend ---------------------------------------------------------------


@pytest.mark.anyio
async def test_a_call_needing_approval_is_recorded_with_no_attempt_and_no_lease(ledger: Ledger) -> None:
    op = await waiting_op(ledger)
    assert (op.state, op.attempts, op.lease_owner, op.lease_expires_at) == (
        State.AWAITING_APPROVAL, 0, None, None,
    )  # fmt: skip
    assert (op.principal, op.session, op.step, op.tool, op.fingerprint) == (
        "alice",
        "s1",
        "k1",
        "charge",
        "fp-1",
    )
    stored = await ledger.get("alice", "s1", "k1")
    assert (
        stored is not None
        and stored == op
        and stored.approval is not None
        and stored.approval.stored() == WAIT
        and stored.expires_at is None
    )
    assert [e.event for e in await ledger.history(op.operation_id)] == ["approval_requested"]
    # the same key again: the existing operation (never a second one); other arguments: a conflict
    again = await ledger.claim(awaiting(), T0 + 1)
    assert (again.kind, again.operation.operation_id) == (ClaimKind.EXISTING, op.operation_id)
    assert (await ledger.claim(request("k1"), T0 + 1)).kind is ClaimKind.EXISTING
    assert (await ledger.claim(awaiting(fingerprint="fp-2"), T0 + 1)).kind is ClaimKind.CONFLICT
    assert (await ledger.counts()).states[State.AWAITING_APPROVAL.value] == 1


@pytest.mark.anyio
async def test_approve_then_exactly_one_take_of_many(ledger: Ledger) -> None:
    op = await waiting_op(ledger)
    approved = await approvals.decide(
        ledger, op.operation_id, "approve", by="ops-anna", via="operator", reason="ok'd", now=T0 + 5
    )
    assert approved.state is State.PENDING and approved.attempts == 0
    assert approved.approval is not None and approved.approval.state == "approved"
    takes = [
        ledger.update(op.operation_id, approvals.take_change(approved, Lease(OWNER, T0 + 20)), T0 + 6)
        for _ in range(8)
    ]
    taken = [t for t in await asyncio.gather(*takes) if t is not None]
    assert len(taken) == 1
    assert (taken[0].state, taken[0].attempts, taken[0].fence) == (State.RUNNING, 1, 1)
    history = await ledger.history(op.operation_id)
    approved_entry = next(e for e in history if e.event == "approved")
    assert (approved_entry.actor, approved_entry.detail) == (
        "operator:ops-anna",
        {"via": "operator", "reason": "ok'd"},
    )


@pytest.mark.anyio
async def test_deny_and_expiry_end_failed_final_and_nothing_is_decided_twice(ledger: Ledger) -> None:
    denied_op, late_op = await waiting_op(ledger, "k1"), await waiting_op(ledger, "k2")
    denied = await approvals.decide(
        ledger, denied_op.operation_id, "deny", by="ops-anna", via="operator", reason="too much", now=T0 + 1
    )
    assert denied.state is State.FAILED_FINAL and denied.error is not None
    assert denied.error.code == ErrorCode.APPROVAL_DENIED.value
    with pytest.raises(ApprovalRefused, match="already denied by ops-anna"):
        await approvals.decide(
            ledger, denied_op.operation_id, "approve", by="x", via="operator", reason=None, now=T0 + 2
        )
    # nobody decided within the timeout: the sweep expires it, a decision afterwards is refused
    assert await approvals.expire_due(ledger, T0 + 59) == []
    expired = await approvals.expire_due(ledger, T0 + 61)
    assert [op.operation_id for op in expired] == [late_op.operation_id]
    assert expired[0].state is State.FAILED_FINAL and expired[0].error is not None
    assert expired[0].error.code == ErrorCode.APPROVAL_EXPIRED.value
    with pytest.raises(ApprovalRefused, match=r"not awaiting approval.*timeout"):
        await approvals.decide(
            ledger, late_op.operation_id, "approve", by="x", via="operator", reason=None, now=T0 + 62
        )


@pytest.mark.anyio
async def test_decisions_are_refused_for_the_wrong_state_principal_or_decider(ledger: Ledger) -> None:
    running = (await ledger.claim(request("r1"), T0)).operation
    with pytest.raises(ApprovalRefused, match="not awaiting approval: it is RUNNING"):
        await approvals.decide(
            ledger, running.operation_id, "approve", by="x", via="operator", reason=None, now=T0
        )
    op = await waiting_op(ledger)
    with pytest.raises(ApprovalRefused, match=r"no operation .* visible to you"):
        await approvals.decide(
            ledger, op.operation_id, "approve", by="bob", via="client", reason=None, now=T0, principal="bob"
        )
    only_operator = dataclasses.replace(
        awaiting("k9"), approval=ApprovalRecord.from_stored({**WAIT, "deciders": ["operator"]})
    )
    op9 = (await ledger.claim(only_operator, T0)).operation
    with pytest.raises(ApprovalRefused, match="only via operator, not via client"):
        await approvals.decide(
            ledger, op9.operation_id, "approve", by="alice", via="client", reason=None, now=T0
        )
    assert (await ledger.get_by_id(None, op.operation_id)).state is State.AWAITING_APPROVAL  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_status_view_shows_the_decision_and_the_advice(ledger: Ledger) -> None:
    op = await waiting_op(ledger)
    view = status_view(op, False, T0)
    assert view["retry_advice"] == RetryAdvice.WAIT_AND_POLL.value
    assert view["approval"]["state"] == "awaiting" and view["approval"]["by"] is None
    approved = await approvals.decide(
        ledger, op.operation_id, "approve", by="anna", via="operator", reason="fine", now=T0 + 1
    )
    view = status_view(approved, False, T0 + 1)
    assert view["retry_advice"] == RetryAdvice.SAFE_TO_RETRY_SAME_KEY.value
    assert {k: view["approval"][k] for k in ("state", "by", "via", "reason")} == {
        "state": "approved", "by": "anna", "via": "operator", "reason": "fine",
    }  # fmt: skip
    assert view["approval"]["decided_at"].endswith("Z")
    denied = await approvals.decide(
        ledger,
        (await waiting_op(ledger, "k2")).operation_id,
        "deny",
        by="anna",
        via="operator",
        reason="no",
        now=T0,
    )
    assert status_view(denied, False, T0)["retry_advice"] == RetryAdvice.DO_NOT_RETRY.value


# --- the boundary -----------------------------------------------------------------------------


def approval_tool(record: SystemOfRecord, when: str = "arguments.amount > 1000", **approval: object) -> tuple:
    source = ScriptedTool(record)
    tool = guarded("refund", "key-required", source, approval={"when": when, "timeout": "1h", **approval})
    return tool, source


@pytest.mark.anyio
async def test_boundary_holds_a_call_that_needs_approval_and_runs_it_once_approved(
    ledger: Ledger, tmp_path: Path
) -> None:
    record = SystemOfRecord(tmp_path / "effects.db")
    tool, _ = approval_tool(record)
    boundary = make_boundary(ledger, [tool])
    small = await boundary.call(call_request(tool, "small", 500))
    assert small.error is None and record.count(key="small") == 1  # below the amount: no approval
    pending = await boundary.call(call_request(tool, "big", 5000))
    assert pending.error is not None and pending.error.code is ErrorCode.APPROVAL_PENDING
    assert pending.operation is not None and pending.operation.state is State.AWAITING_APPROVAL
    again = await boundary.call(call_request(tool, "big", 5000))
    assert again.error is not None and again.error.code is ErrorCode.APPROVAL_PENDING
    other = await boundary.call(call_request(tool, "big", 6000))
    assert other.error is not None and other.error.code is ErrorCode.IDEMPOTENCY_KEY_REUSED
    assert record.count(key="big") == 0
    await approvals.decide(
        ledger,
        pending.operation.operation_id,
        "approve",
        by="anna",
        via="operator",
        reason=None,
        now=boundary.clock(),
    )
    answers = await asyncio.gather(*(boundary.call(call_request(tool, "big", 5000)) for _ in range(8)))
    assert record.count(key="big") == 1
    assert all(a.error is None for a in answers), [a.error and a.error.code for a in answers]
    assert sum(not a.replayed for a in answers) == 1


@pytest.mark.anyio
async def test_boundary_answers_denied_and_expired_without_any_effect(ledger: Ledger, tmp_path: Path) -> None:
    record = SystemOfRecord(tmp_path / "effects.db")
    clock = FakeClock(T0)
    tool, _ = approval_tool(record, when="true")
    boundary = make_boundary(ledger, [tool], clock=clock)
    metrics = Metrics()
    boundary.observers.append(metrics)
    denied = await boundary.call(call_request(tool, "d1"))
    assert denied.operation is not None
    await approvals.decide(
        ledger, denied.operation.operation_id, "deny", by="anna", via="operator", reason="no", now=clock()
    )
    answer = await boundary.call(call_request(tool, "d1"))
    assert answer.error is not None and answer.error.code is ErrorCode.APPROVAL_DENIED
    assert "denied" in answer.error.message and "Do not retry" in answer.error.message
    await boundary.call(call_request(tool, "e1"))
    clock.advance(3601)  # past the timeout: the next touch expires it
    answer = await boundary.call(call_request(tool, "e1"))
    assert answer.error is not None and answer.error.code is ErrorCode.APPROVAL_EXPIRED
    assert record.count() == 0
    expired = metrics.registry.get_sample_value(
        "commitgate_approvals_expired_total", {"tool": "refund", "idempotency_class": "key-required"}
    )
    assert expired == 1.0


@pytest.mark.anyio
async def test_an_expression_that_fails_requires_approval(
    ledger: Ledger, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record = SystemOfRecord(tmp_path / "effects.db")
    tool, _ = approval_tool(record, when="arguments.missing > 3")
    boundary = make_boundary(ledger, [tool])
    answer = await boundary.call(call_request(tool, "k1"))
    assert answer.error is not None and answer.error.code is ErrorCode.APPROVAL_PENDING
    assert "could not be evaluated" in caplog.text and record.count() == 0
    assert answer.operation is not None and answer.operation.approval is not None
    assert "missing" in (answer.operation.approval.required_because or "")


@pytest.mark.anyio
async def test_a_duplicate_goes_to_a_person_with_the_earlier_operation(
    ledger: Ledger, tmp_path: Path
) -> None:
    record = SystemOfRecord(tmp_path / "effects.db")
    source = ScriptedTool(record)
    tool = guarded("refund", "key-required", source, duplicates={"action": "approval"})
    boundary = make_boundary(ledger, [tool])
    first = await boundary.call(call_request(tool, "k1"))
    assert first.error is None and first.operation is not None
    repeat = await boundary.call(call_request(tool, "k2"))
    assert repeat.error is not None and repeat.error.code is ErrorCode.APPROVAL_PENDING
    assert repeat.operation is not None and repeat.operation.approval is not None
    assert repeat.operation.approval.duplicate_of == first.operation.operation_id
    asked = approvals.question(repeat.operation, tool.policy, first.operation)
    assert first.operation.operation_id in asked.text and "Possible duplicate" in asked.text
    await approvals.decide(
        ledger,
        repeat.operation.operation_id,
        "approve",
        by="anna",
        via="operator",
        reason=None,
        now=boundary.clock(),
    )
    assert (await boundary.call(call_request(tool, "k2"))).error is None
    assert record.count() == 2


def test_the_question_masks_secret_arguments_and_fills_the_prompt() -> None:
    arguments = {
        "amount_cents": 25000,
        "card_number": "4242424242424242",
        "api_token": "sekrit",
        "note": "refund",
    }
    op = Operation(
        "op_1", "alice", "s1", "k1", "pay", IdempotencyClass.KEY_REQUIRED, "fp", State.AWAITING_APPROVAL, 0, 0,
        arguments, T0, T0,
    )  # fmt: skip
    policy = loads_policy(
        '[tools.pay]\nclass = "key-required"\npython = "commitgate.server.demo.tools:refund"\n'
        'approval = { prompt = "Pay {arguments.amount_cents} cents with {arguments.card_number}?" }\n'
    ).tools["pay"]
    text = approvals.question(op, policy).text
    assert "Pay 25000 cents with •••• 4242?" in text and "alice" in text and "pay" in text
    assert "4242424242424242" not in text and "sekrit" not in text and "refund" in text


# --- the policy ---------------------------------------------------------------------------------

BAD = textwrap.dedent(
    """\
    [tools.refund]
    class = "key-required"
    python = "commitgate.server.demo.tools:refund"
    approval = { when = "arguments.amount_cents >" }

    [tools.charge]
    class = "key-required"
    python = "commitgate.server.demo.tools:refund"
    approval = { when = "amount > 3", prompt = "{result.id}" }

    [tools.lookup]
    class = "safe-retry"
    python = "commitgate.server.demo.tools:get_balance"
    approval = { via = ["boss"] }
    """
)


def test_policy_check_reports_approval_problems_with_their_lines() -> None:
    problems = {(p.location, p.line): p.message for p in analyse_text(BAD).problems}
    assert "is not valid CEL" in problems[("tools.refund.approval.when", 4)]
    assert "unknown name 'amount'" in problems[("tools.charge.approval.when", 9)]
    assert "only {arguments.X}" in problems[("tools.charge.approval.prompt", 9)]
    assert "safe-retry" in problems[("tools.lookup.approval", 14)]
    assert "'client' or 'operator'" in problems[("tools.lookup.approval.via[0]", 14)]
    with pytest.raises(PolicyError):
        loads_policy(BAD)


def test_approval_defaults() -> None:
    policy = loads_policy(
        '[tools.r]\nclass = "key-required"\npython = "commitgate.server.demo.tools:refund"\napproval = {}\n'
    )
    approval = policy.tools["r"].approval
    assert approval is not None
    assert (approval.when.source, approval.timeout, approval.via, approval.prompt) == (
        "true", 86400.0, ["client", "operator"], None,
    )  # fmt: skip


def test_the_description_tells_the_model_what_approval_pending_means() -> None:
    policy = loads_policy(
        '[tools.r]\nclass = "key-required"\npython = "commitgate.server.demo.tools:refund"\napproval = {}\n'
        '[tools.s]\nclass = "key-required"\npython = "commitgate.server.demo.tools:refund"\n'
    )
    served = build_tools(policy, None)
    assert APPROVAL_SENTENCE in (served["r"].definition.description or "")
    assert APPROVAL_SENTENCE not in (served["s"].definition.description or "")


@pytest.mark.anyio
async def test_the_approval_benchmark_runs_and_reports_its_figures(tmp_path: Path) -> None:
    figures = await measure(calls=4, rounds=1, directory=tmp_path)
    assert set(figures["median_us"]) == {"plain", "same", "checked", "waits"}
    assert {"check_adds_us", "noise_us", "waiting_instead_of_running_us"} <= set(figures)


@pytest.mark.anyio
async def test_a_fresh_key_repeat_of_a_waiting_call_is_a_duplicate_not_a_second_wait(ledger: Ledger) -> None:
    check = DuplicateCheck(window_seconds=600.0, any_session=False, reject=True)
    first = await ledger.claim(dataclasses.replace(awaiting("k1"), duplicates=check), T0)
    assert first.kind is ClaimKind.AWAITING
    again = await ledger.claim(dataclasses.replace(awaiting("k2"), duplicates=check), T0 + 1)
    assert (again.kind, again.operation.operation_id) == (ClaimKind.DUPLICATE, first.operation.operation_id)
    allowed = dataclasses.replace(check, reject=False)
    third = await ledger.claim(dataclasses.replace(awaiting("k3"), duplicates=allowed), T0 + 2)
    assert third.kind is ClaimKind.AWAITING and third.duplicate_of == first.operation.operation_id
    events = [e.event for e in await ledger.history(third.operation.operation_id)]
    assert events == ["approval_requested", "possible_duplicate"]


@pytest.mark.anyio
async def test_a_first_round_that_asks_the_client_is_replied_as_input_required(tmp_path: Path) -> None:
    from commitgate.server.serve.asking import ClientChannel
    from commitgate.server.serve.gateway import Gateway

    policy = loads_policy(
        '[tools.r]\nclass = "key-required"\npython = "commitgate.server.demo.tools:refund"\n'
        'approval = { via = ["client"] }\n'
    )
    policy.ledger.url = f"sqlite:///{tmp_path / 'ledger.db'}"
    gateway = await Gateway.open(policy, None)
    try:
        arguments = {"charge_id": "ch_1", "amount_cents": 5, "idempotency_key": "k1"}
        call = gateway.envelope("r", arguments, {}, "alice", ClientChannel(multi_round=True))
        reply = await gateway.reply(call)
    finally:
        await gateway.close()
    assert isinstance(reply.result, InputRequiredResult)  # the SDK sends it as it is
    assert (reply.code, reply.operation, reply.message) == ("input_required", None, None)


@pytest.mark.anyio
async def test_ops_approve_and_deny_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from support.policy import run

    from commitgate.server.ledger.sqlite import SQLiteLedger

    path = tmp_path / "ledger.db"
    ledger = await SQLiteLedger.open(path)
    now = time.time()  # the CLI decides at the real time: the wait must not have run out
    try:
        claim = dataclasses.replace(
            awaiting(),
            approval=ApprovalRecord.from_stored({**WAIT, "requested_at": now, "expires_at": now + 3600}),
        )
        op = (await ledger.claim(claim, now)).operation
    finally:
        await ledger.close()
    url = f"sqlite:///{path}"
    bad = await anyio.to_thread.run_sync(
        run, capsys, ["ops", "approve", op.operation_id, "--by", "eve\x1b[2J", "--ledger", url]
    )
    assert bad.code == 1 and "--by must be a name of printable characters" in bad.err
    listed = await anyio.to_thread.run_sync(
        run, capsys, ["ops", "list", "--state", "AWAITING_APPROVAL", "--ledger", url, "--json"]
    )
    assert [o["operation_id"] for o in json.loads(listed.out)["operations"]] == [op.operation_id]
    done = await anyio.to_thread.run_sync(
        run,
        capsys,
        ["ops", "approve", op.operation_id, "--by", "anna", "--reason", "fine", "--ledger", url, "--json"],
    )
    assert done.code == 0, done.err
    view = json.loads(done.out)
    assert (
        view["state"] == "PENDING"
        and view["approval"]["by"] == "anna"
        and view["approval"]["via"] == "operator"
    )
    twice = await anyio.to_thread.run_sync(
        run, capsys, ["ops", "deny", op.operation_id, "--reason", "no", "--ledger", url]
    )
    assert twice.code == 1 and "refused" in twice.err and "already approved by anna" in twice.err
    shown = await anyio.to_thread.run_sync(run, capsys, ["ops", "show", op.operation_id, "--ledger", url])
    assert shown.code == 0 and "approval:" in shown.out and '"by":"anna"' in shown.out.replace(" ", "")


@pytest.mark.anyio
async def test_the_sweep_expires_every_due_wait_however_many_newer_ones_wait(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(approvals, "_SWEEP_BATCH", 3)
    for i in range(7):  # older waits, due first
        await ledger.claim(
            dataclasses.replace(
                awaiting(f"old-{i}"), approval=ApprovalRecord.from_stored({**WAIT, "expires_at": T0 + 10})
            ),
            T0,
        )
    for i in range(5):  # newer ones, not due yet
        await ledger.claim(
            dataclasses.replace(
                awaiting(f"new-{i}"), approval=ApprovalRecord.from_stored({**WAIT, "expires_at": T0 + 900})
            ),
            T0 + 1,
        )
    expired = await approvals.expire_due(ledger, T0 + 60)
    assert sorted(op.step for op in expired) == [f"old-{i}" for i in range(7)]
    assert (await ledger.counts()).states[State.AWAITING_APPROVAL.value] == 5
