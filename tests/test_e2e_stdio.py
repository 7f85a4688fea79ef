"""End to end over stdio: real `commitgate serve` processes, the SDK client, effects counted in the sandbox.

Most tests share one server per protocol era (module scope, one session per
test). Tests that inject faults, restart or kill servers, or change the
principal get their own deployment, since fault budgets live in the sandbox.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.types import CallToolResult
from support.e2e import (
    CONSOLE_SCRIPT,
    SESSION_META,
    STEP_META,
    Deployment,
    Server,
    as_meta,
    error,
    error_code,
    new_id,
    operation,
    serve,
    text_of,
    together,
)

from commitgate.server.demo.tools import DECLINED_CARD

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODES = ["auto", "legacy"]
CARD = "4242424242424242"
REPO = Path(__file__).resolve().parent.parent
DESKTOP_CONFIG = REPO / "claude_desktop_config.example.json"


@pytest.fixture(scope="module")
def shared_deployment(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    return Deployment.create(tmp_path_factory.mktemp("e2e-shared"), max_argument_bytes=4096)


@pytest.fixture(scope="module", params=MODES)
async def shared(
    request: pytest.FixtureRequest, shared_deployment: Deployment, anyio_backend: str
) -> AsyncIterator[Server]:
    """One server process per protocol era, shared by the tests that need no faults."""
    async with serve(shared_deployment, mode=request.param) as server:
        yield server


@pytest.fixture
def session() -> str:
    return new_id("s")


def charge(key: str | None, amount: int = 1250, card: str = CARD) -> dict[str, Any]:
    args: dict[str, Any] = {"card": card, "amount_cents": amount, "description": "order"}
    if key is not None:
        args["idempotency_key"] = key
    return args


def email(key: str | None, to: str = "ada@example.com") -> dict[str, Any]:
    args: dict[str, Any] = {"to": to, "subject": "Your order", "body": "It ships today."}
    if key is not None:
        args["idempotency_key"] = key
    return args


def content_json(result: CallToolResult) -> list[dict[str, Any]]:
    return [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content]


def succeeded(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.structured_content
    op = operation(result)
    assert op["state"] == "SUCCEEDED"
    return op


# --------------------------------------------------------------------------- the surface


async def test_tools_list_follows_the_classes(shared: Server) -> None:
    tools = {tool.name: tool for tool in (await shared.client.list_tools()).tools}
    assert {"charge_card", "send_email", "get_balance", "get_operation_status", "list_operations"} <= set(
        tools
    )
    for name in ("charge_card", "send_email"):
        schema = tools[name].input_schema
        assert "idempotency_key" in schema["required"]
        assert schema["properties"]["idempotency_key"]["maxLength"] == 255
        annotations = tools[name].annotations
        assert annotations is not None
        assert annotations.read_only_hint is False and annotations.idempotent_hint is True
    balance = tools["get_balance"]
    assert "idempotency_key" not in balance.input_schema.get("properties", {})
    assert balance.annotations is not None and balance.annotations.read_only_hint is True
    status = tools["get_operation_status"].annotations
    assert status is not None and status.read_only_hint is True


# --------------------------------------------------------------------------- replay and keys


@pytest.mark.parametrize(("tool", "table"), [("charge_card", "charges"), ("send_email", "emails")])
async def test_replay_returns_the_first_outcome_and_acts_once(
    shared: Server, session: str, tool: str, table: str
) -> None:
    args = charge("order-1") if tool == "charge_card" else email("order-1")
    first = await shared.call(tool, args, session=session)
    again = await shared.call(tool, args, session=session)

    op, replay = succeeded(first), succeeded(again)
    assert again.content[:-1] == first.content  # then the note that nothing ran again
    assert again.structured_content == first.structured_content
    assert op["replayed"] is False and replay["replayed"] is True
    assert replay["operation_id"] == op["operation_id"]
    assert (op["session"], op["idempotency_key"], op["attempts"]) == (session, "order-1", 1)
    assert op["created_at"] and op["completed_at"]
    assert shared.deployment.count(table, idempotency_key="order-1", session=session) == 1


async def test_reusing_a_key_for_other_arguments_or_another_tool_executes_nothing(
    shared: Server, session: str
) -> None:
    d = shared.deployment
    first = await shared.call("charge_card", charge("k-1", amount=500), session=session)
    first_id = succeeded(first)["operation_id"]

    other_arguments = await shared.call("charge_card", charge("k-1", amount=900), session=session)
    other_tool = await shared.call("send_email", email("k-1"), session=session)
    for result in (other_arguments, other_tool):
        problem = error(result)
        assert problem["code"] == "idempotency_key_reused"
        assert problem["operation"]["operation_id"] == first_id
    assert d.count("charges", session=session) == 1
    assert d.count("charges", session=session, amount_cents=900) == 0
    assert d.count("emails", session=session) == 0

    # The first outcome is untouched, and the same key in another session is another operation.
    assert succeeded(await shared.call("charge_card", charge("k-1", amount=500), session=session))["replayed"]
    elsewhere = await shared.call("charge_card", charge("k-1", amount=500), session=session + "-b")
    assert succeeded(elsewhere)["replayed"] is False
    assert d.count("charges", idempotency_key="k-1", session=session) == 1
    assert d.count("charges", idempotency_key="k-1", session=session + "-b") == 1


async def test_key_checks(shared: Server, session: str) -> None:
    d = shared.deployment
    assert error_code(await shared.call("send_email", email(None), session=session)) == (
        "idempotency_key_required"
    )
    for bad in ("k" * 256, "has space", "semi;colon", "ümlaut"):
        result = await shared.call("send_email", email(bad), session=session)
        assert error_code(result) == "invalid_idempotency_key", bad
    differ = await shared.call("send_email", email("in-argument"), session=session, step="in-meta")
    assert error_code(differ) == "invalid_idempotency_key"
    not_text = await shared.client.call_tool(
        "send_email", email(None), meta=as_meta({SESSION_META: session, STEP_META: 12345})
    )
    assert error_code(not_text) == "invalid_idempotency_key"
    assert d.count("emails", session=session) == 0
    assert await shared.operations(session=session) == []  # nothing recorded either

    longest = "k" * 255
    assert succeeded(await shared.call("send_email", email(longest), session=session))["replayed"] is False
    # another email (other arguments): the same ones under a new key would be a possible duplicate
    via_meta = await shared.call(
        "send_email", email(None, to="bo@example.com"), session=session, step="step-7"
    )
    op = succeeded(via_meta)
    assert (op["idempotency_key"], op["replayed"]) == ("step-7", False)
    # The step is the key whichever way it travels: argument, _meta, or both agreeing.
    bo = "bo@example.com"
    assert succeeded(await shared.call("send_email", email("step-7", to=bo), session=session))["replayed"]
    both = await shared.call("send_email", email("step-7", to=bo), session=session, step="step-7")
    assert succeeded(both)["replayed"] is True
    assert d.count("emails", session=session, idempotency_key="step-7") == 1
    assert d.count("emails", session=session, idempotency_key=longest) == 1


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"card": CARD, "amount_cents": "lots"}, "amount_cents"),
        ({"card": CARD, "amount_cents": 100, "colour": "red"}, "colour"),
        ({"amount_cents": 100}, "card"),
    ],
    ids=["wrong-type", "unknown-argument", "missing-field"],
)
async def test_bad_arguments_name_the_field_and_record_nothing(
    shared: Server, session: str, arguments: dict[str, Any], field: str
) -> None:
    result = await shared.call("charge_card", {**arguments, "idempotency_key": "bad-1"}, session=session)
    problem = error(result)
    assert problem["code"] == "invalid_arguments"
    assert field in problem["message"]
    assert problem["operation"] is None
    assert shared.deployment.count("charges", session=session) == 0
    assert (await shared.status(session, idempotency_key="bad-1"))["found"] is False
    # The server still answers, and the key was not burnt by the bad call.
    assert succeeded(await shared.call("charge_card", charge("bad-1"), session=session))["replayed"] is False


async def test_oversized_arguments_are_refused_before_anything_is_recorded(
    shared: Server, session: str
) -> None:
    big = {**charge("big-1"), "description": "x" * 5000}  # the shared policy allows 4096 bytes
    problem = error(await shared.call("charge_card", big, session=session))
    assert (problem["code"], problem["operation"]) == ("invalid_arguments", None)
    assert "4096" in problem["message"]
    assert (await shared.status(session, idempotency_key="big-1"))["found"] is False
    assert shared.deployment.count("charges", session=session) == 0


async def test_an_unknown_tool_is_a_protocol_error(shared: Server) -> None:
    with pytest.raises(MCPError):
        await shared.call("no_such_tool", {})
    assert (await shared.client.list_tools()).tools  # still serving


# --------------------------------------------------------------------------- status and listings


async def test_status_by_key_and_by_operation_id(shared: Server, session: str) -> None:
    first = await shared.call("charge_card", charge("st-1"), session=session)
    op_id = succeeded(first)["operation_id"]

    by_key = await shared.status(session, idempotency_key="st-1")
    by_key_argument = await shared.status(None, idempotency_key="st-1", session=session)
    by_id = await shared.status(None, operation_id=op_id)
    for answer in (by_key, by_key_argument, by_id):
        assert answer["found"] is True
        found = answer["operation"]
        assert found["operation_id"] == op_id
        assert (found["tool"], found["idempotency_class"]) == ("charge_card", "key-and-status-check")
        assert (found["session"], found["idempotency_key"]) == (session, "st-1")
        assert (found["state"], found["retry_advice"]) == ("SUCCEEDED", "done")
        assert found["result"]["structuredContent"] == first.structured_content
        assert found["result"]["content"] == content_json(first)
        assert found["created_at"] and found["updated_at"] and found["expires_at"]

    assert await shared.status(session, idempotency_key="never-used") == {"found": False, "operation": None}
    assert (await shared.status(session + "-other", idempotency_key="st-1"))["found"] is False
    assert (await shared.status(None, operation_id="op_does_not_exist"))["found"] is False
    neither = await shared.call("get_operation_status", {}, session=session)
    assert error_code(neither) == "invalid_arguments"


async def test_list_operations_newest_first_and_filtered(shared: Server, session: str) -> None:
    await shared.call("charge_card", charge("l-1"), session=session)
    await shared.call("send_email", email("l-2"), session=session)
    await shared.call("charge_card", charge("l-3", card=DECLINED_CARD), session=session)
    await shared.call("charge_card", charge("l-4"), session=session + "-other")

    listed = await shared.operations(session=session)
    assert [op["idempotency_key"] for op in listed] == ["l-3", "l-2", "l-1"]
    assert [op["created_at"] for op in listed] == sorted((op["created_at"] for op in listed), reverse=True)
    assert {op["retry_advice"] for op in listed} == {"done", "do_not_retry"}
    failed = await shared.operations(session=session, state="FAILED_FINAL")
    assert [op["idempotency_key"] for op in failed] == ["l-3"]
    emails = await shared.operations(session=session, tool="send_email")
    assert [op["idempotency_key"] for op in emails] == ["l-2"]
    assert [op["idempotency_key"] for op in await shared.operations(session=session, limit=1)] == ["l-3"]
    # Without a session: every session of this principal, newest first.
    everything = await shared.operations(limit=200)
    keys = [(op["session"], op["idempotency_key"]) for op in everything]
    assert keys.index((session + "-other", "l-4")) < keys.index((session, "l-3"))


async def test_a_declined_card_fails_final_and_replays_as_is(shared: Server, session: str) -> None:
    first = await shared.call("charge_card", charge("decl-1", card=DECLINED_CARD), session=session)
    again = await shared.call("charge_card", charge("decl-1", card=DECLINED_CARD), session=session)
    problem, replay = error(first), error(again)
    assert problem["code"] == replay["code"] == "operation_failed"
    assert problem["message"] == replay["message"] and "declined" in problem["message"]
    assert problem["operation"]["state"] == "FAILED_FINAL"
    assert problem["operation"]["operation_id"] == replay["operation"]["operation_id"]
    assert problem["operation"]["replayed"] is False and replay["operation"]["replayed"] is True
    assert replay["operation"]["attempts"] == 1  # a permanent failure is not retried

    status = (await shared.status(session, idempotency_key="decl-1"))["operation"]
    assert (status["state"], status["retry_advice"]) == ("FAILED_FINAL", "do_not_retry")
    assert status["error"]
    assert shared.deployment.count("charges", card=DECLINED_CARD, session=session) == 0


async def test_a_slow_operation_answers_in_progress_then_polls_to_done(
    shared: Server, session: str, tmp_path: Path
) -> None:
    d = shared.deployment
    gate = tmp_path / "gate"
    args = {"gate": str(gate), "label": "report", "idempotency_key": "slow-1"}
    try:
        first = await shared.call("gated_task", args, session=session)  # outlives respond_within
        problem = error(first)
        assert problem["code"] == "operation_in_progress"
        assert problem["operation"]["state"] == "RUNNING"
        running = (await shared.status(session, idempotency_key="slow-1"))["operation"]
        assert (running["state"], running["retry_advice"]) == ("RUNNING", "wait_and_poll")
        assert running["lease_expires_at"]
        duplicate = await shared.call("gated_task", args, session=session)  # bounded wait, then in progress
        assert error_code(duplicate) == "operation_in_progress"
        assert d.count("tasks", session=session) == 0
    finally:
        gate.touch()
    done = await shared.wait_for_state(session, "slow-1", {"SUCCEEDED"})
    assert done["retry_advice"] == "done"
    replay = await shared.call("gated_task", args, session=session)
    assert succeeded(replay)["replayed"] is True
    assert replay.structured_content == done["result"]["structuredContent"]
    assert d.count("tasks", session=session, idempotency_key="slow-1") == 1


async def test_sixteen_concurrent_calls_with_one_key_act_once(shared: Server, session: str) -> None:
    results: list[CallToolResult] = []

    async def one() -> None:
        results.append(await shared.call("charge_card", charge("burst"), session=session))

    async with anyio.create_task_group() as tg:
        for _ in range(16):
            tg.start_soon(one)

    answers = [r for r in results if not r.is_error]
    assert {error_code(r) for r in results if r.is_error} <= {"operation_in_progress"}
    assert answers
    assert all(r.structured_content == answers[0].structured_content for r in answers)
    assert len({operation(r)["operation_id"] for r in answers}) == 1
    assert sum(1 for r in answers if not operation(r)["replayed"]) <= 1
    assert shared.deployment.count("charges", session=session, idempotency_key="burst") == 1


# --------------------------------------------------------------------------- failures, with their own servers


async def test_transient_failures_exhaust_retries_and_the_same_key_may_run_again(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path)
    async with serve(d, faults="charge_card.fail_before=4x") as server:  # one more failure than attempts
        first = await server.call("charge_card", charge("pay-1"), session="s")
        problem = error(first)
        assert problem["code"] == "retries_exhausted"
        assert problem["operation"]["state"] == "FAILED_RETRYABLE"
        assert d.fault_remaining("charge_card", "fail_before") == 1  # exactly retry.attempts = 3 attempts
        status = (await server.status("s", idempotency_key="pay-1"))["operation"]
        assert (status["state"], status["retry_advice"]) == ("FAILED_RETRYABLE", "safe_to_retry_same_key")
        assert d.count("charges") == 0

        # Following the advice: the same key runs again until it lands, once.
        for _ in range(3):
            retry = await server.call("charge_card", charge("pay-1"), session="s")
            if not retry.is_error:
                break
            assert error_code(retry) == "retries_exhausted"
        op = succeeded(retry)
        assert op["operation_id"] == problem["operation"]["operation_id"]
        assert d.count("charges", idempotency_key="pay-1") == 1
        assert d.fault_remaining("charge_card", "fail_before") == 0


async def test_a_lost_acknowledgement_on_a_key_required_tool_is_unknown_and_never_rerun(
    tmp_path: Path,
) -> None:
    d = Deployment.create(tmp_path)
    async with serve(d, mode="legacy", faults="send_email.lose_ack=1x") as server:
        first = await server.call("send_email", email("mail-1"), session="s")
        problem = error(first)
        assert problem["code"] == "operation_outcome_unknown"
        assert problem["operation"]["state"] == "UNKNOWN"
        status = (await server.status("s", idempotency_key="mail-1"))["operation"]
        assert (status["state"], status["retry_advice"]) == ("UNKNOWN", "do_not_retry")

        again = await server.call("send_email", email("mail-1"), session="s")
        assert error_code(again) == "operation_outcome_unknown"
        assert error(again)["operation"]["operation_id"] == problem["operation"]["operation_id"]
        assert problem["operation"]["replayed"] is False and error(again)["operation"]["replayed"] is True
        assert d.count("emails", idempotency_key="mail-1") == 1  # sent once, never re-sent


async def test_a_lost_acknowledgement_on_a_status_check_tool_is_reconciled_in_the_call(
    tmp_path: Path,
) -> None:
    d = Deployment.create(tmp_path)
    async with serve(d, faults="charge_card.lose_ack=1x") as server:
        result = await server.call("charge_card", charge("ack-1"), session="s")
        op = succeeded(result)
        assert op["replayed"] is True  # the answer came from the status check, not this call's execution
        (row,) = d.rows("charges", idempotency_key="ack-1")
        assert result.structured_content is not None and result.structured_content["charge_id"] == row["id"]
        status = (await server.status("s", idempotency_key="ack-1"))["operation"]
        assert (status["state"], status["retry_advice"]) == ("SUCCEEDED", "done")
        assert status["reconciliation"]
        assert succeeded(await server.call("charge_card", charge("ack-1"), session="s"))["replayed"] is True
        assert d.count("charges") == 1


async def test_a_safe_retry_tool_is_retried_automatically(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path)
    # Five injected failures: the first call spends three (all its attempts), the second call two.
    async with serve(d, mode="legacy", faults="get_balance.fail_before=5x") as server:
        exhausted = await server.call("get_balance", {"card": CARD}, session="s")
        problem = error(exhausted)
        assert (problem["code"], problem["operation"]) == ("retries_exhausted", None)
        assert d.fault_remaining("get_balance", "fail_before") == 2

        # An idempotency_key is accepted and ignored; the third attempt succeeds.
        balance = await server.call("get_balance", {"card": CARD, "idempotency_key": "x"}, session="s")
        assert not balance.is_error, balance.structured_content
        assert balance.structured_content == {"card": CARD, "cents": 0}
        assert operation(balance) == {}  # safe-retry calls are not recorded
        assert d.fault_remaining("get_balance", "fail_before") == 0
        assert await server.operations(session="s") == []


# --------------------------------------------------------------------------- restarts, crashes, many processes


async def test_a_restarted_server_replays_from_the_ledger(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path)
    async with serve(d, mode="auto") as server:
        first = await server.call("charge_card", charge("rs-1"), session="s")
        succeeded(first)
    async with serve(d, mode="legacy") as server:
        again = await server.call("charge_card", charge("rs-1"), session="s")
        assert succeeded(again)["replayed"] is True
        assert again.content[:-1] == first.content  # then the note that nothing ran again
        assert again.structured_content == first.structured_content
        assert operation(again)["operation_id"] == operation(first)["operation_id"]
    assert d.count("charges", idempotency_key="rs-1") == 1


async def test_four_server_processes_on_one_ledger_act_once(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path)
    results: list[CallToolResult] = []
    async with together(*(serve(d, mode=mode) for mode in MODES * 2)) as servers:

        async def burst(server: Server) -> None:
            for _ in range(2):
                results.append(await server.call("charge_card", charge("shared-1"), session="s"))

        async with anyio.create_task_group() as tg:
            for server in servers:
                for _ in range(2):
                    tg.start_soon(burst, server)

    assert len(results) == 16
    answers = [r for r in results if not r.is_error]
    assert {error_code(r) for r in results if r.is_error} <= {"operation_in_progress"}
    assert answers and all(r.structured_content == answers[0].structured_content for r in answers)
    assert d.count("charges", idempotency_key="shared-1") == 1


async def _crash_during(server: Server, tool: str, arguments: dict[str, Any]) -> None:
    """Call a tool whose fault kills the server after the effect, before the ledger write."""
    with pytest.raises(MCPError):  # the connection closes under the call
        await server.call(tool, arguments, session="s")


@pytest.mark.parametrize(("first_mode", "second_mode"), [("auto", "legacy"), ("legacy", "auto")])
async def test_a_crash_after_an_email_leaves_it_unknown_and_never_resent(
    tmp_path: Path, first_mode: str, second_mode: str
) -> None:
    d = Deployment.create(tmp_path, lease="1s", in_progress_wait="3s")
    async with serve(d, mode=first_mode, faults="send_email.crash_after_effect=1x") as server:
        await _crash_during(server, "send_email", email("crash-1"))
    assert d.count("emails", idempotency_key="crash-1") == 1
    async with serve(d, mode=second_mode) as server:
        retry = await server.call("send_email", email("crash-1"), session="s")
        assert error_code(retry) == "operation_outcome_unknown"
        status = (await server.status("s", idempotency_key="crash-1"))["operation"]
        assert (status["state"], status["retry_advice"]) == ("UNKNOWN", "do_not_retry")
        assert error_code(await server.call("send_email", email("crash-1"), session="s")) == (
            "operation_outcome_unknown"
        )
    assert d.count("emails", idempotency_key="crash-1") == 1


@pytest.mark.parametrize(
    ("first_mode", "second_mode", "poll_first"),
    [("auto", "legacy", False), ("legacy", "auto", True)],
    ids=["call-after-restart", "poll-after-restart"],
)
async def test_a_crash_after_a_charge_is_reconciled_after_restart(
    tmp_path: Path, first_mode: str, second_mode: str, poll_first: bool
) -> None:
    d = Deployment.create(tmp_path, lease="1s", in_progress_wait="3s")
    async with serve(d, mode=first_mode, faults="charge_card.crash_after_effect=1x") as server:
        await _crash_during(server, "charge_card", charge("crash-2"))
    (row,) = d.rows("charges", idempotency_key="crash-2")
    async with serve(d, mode=second_mode) as server:
        if poll_first:  # a poll reconciles a status-check operation whose owner died
            polled = await server.wait_for_state("s", "crash-2", {"SUCCEEDED"})
            assert polled["result"]["structuredContent"]["charge_id"] == row["id"]
            assert polled["reconciliation"]
        retry = await server.call("charge_card", charge("crash-2"), session="s")
        assert succeeded(retry)["replayed"] is True
        assert retry.structured_content is not None and retry.structured_content["charge_id"] == row["id"]
        status = (await server.status("s", idempotency_key="crash-2"))["operation"]
        assert (status["state"], status["retry_advice"]) == ("SUCCEEDED", "done")
        assert status["reconciliation"]
    assert d.count("charges", idempotency_key="crash-2") == 1


async def test_kill_9_while_running_turns_unknown_and_is_never_rerun(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path, lease="1s", respond_within="300ms", in_progress_wait="3s")
    gate = tmp_path / "gate"
    args = {"gate": str(gate), "label": "nightly", "idempotency_key": "kill-1"}
    async with serve(d) as server:
        assert error_code(await server.call("gated_task", args, session="s")) == "operation_in_progress"
        server.kill9()
    gate.touch()  # nothing is left to pass it: the process that ran the task is gone
    async with serve(d, mode="legacy") as server:
        status = await server.wait_for_state("s", "kill-1", {"UNKNOWN"})
        assert status["retry_advice"] == "do_not_retry"
        assert error_code(await server.call("gated_task", args, session="s")) == "operation_outcome_unknown"
    assert d.count("tasks", idempotency_key="kill-1") == 0


@pytest.mark.parametrize("poll_first", [True, False], ids=["poll-after-restart", "call-after-restart"])
async def test_a_charge_killed_before_its_effect_is_found_missing_and_runs_once(
    tmp_path: Path, poll_first: bool
) -> None:
    d = Deployment.create(tmp_path, lease="1s", respond_within="300ms", in_progress_wait="3s")
    async with serve(d, faults="charge_card.latency=30s") as server:  # stalls before charging
        assert error_code(await server.call("charge_card", charge("late-1"), session="s")) == (
            "operation_in_progress"
        )
        server.kill9()
    assert d.count("charges") == 0
    async with serve(d, mode="legacy") as server:
        if poll_first:  # the status check finds nothing: certainly not applied
            status = await server.wait_for_state("s", "late-1", {"FAILED_RETRYABLE"})
            assert status["retry_advice"] == "safe_to_retry_same_key"
            assert status["reconciliation"]
        result = await server.call("charge_card", charge("late-1"), session="s")
        assert succeeded(result)["replayed"] is False  # executed in this very call
    assert d.count("charges", idempotency_key="late-1") == 1


# --------------------------------------------------------------------------- principals


async def test_principals_do_not_see_each_others_operations(tmp_path: Path) -> None:
    alice = Deployment.create(tmp_path, name="alice.toml", principal="alice")
    bob = alice.with_policy("bob.toml", principal="bob")
    async with together(serve(alice), serve(bob, mode="legacy")) as (as_alice, as_bob):
        first = await as_alice.call("charge_card", charge("p-1"), session="s")
        op_id = succeeded(first)["operation_id"]

        assert (await as_bob.status("s", idempotency_key="p-1"))["found"] is False
        assert (await as_bob.status(None, operation_id=op_id))["found"] is False
        assert await as_bob.operations() == []

        theirs = await as_bob.call("charge_card", charge("p-1"), session="s")
        assert succeeded(theirs)["replayed"] is False
        assert operation(theirs)["operation_id"] != op_id
        assert [op["operation_id"] for op in await as_alice.operations()] == [op_id]
    assert alice.count("charges", idempotency_key="p-1", principal="alice") == 1
    assert alice.count("charges", idempotency_key="p-1", principal="bob") == 1


# --------------------------------------------------------------------------- the Claude Desktop example


async def test_the_claude_desktop_example_config_starts_the_server(tmp_path: Path) -> None:
    entry = json.loads(DESKTOP_CONFIG.read_text(encoding="utf-8"))["mcpServers"]["commitgate"]
    command = shutil.which(entry["command"], path=str(CONSOLE_SCRIPT.parent))
    assert command is not None, f"{entry['command']!r} is not a console script of this environment"
    state = tmp_path / "state"
    env = {
        **entry.get("env", {}),
        "COMMITGATE_SANDBOX": str(tmp_path / "sandbox.db"),
        "HOME": str(tmp_path),
        "XDG_STATE_HOME": str(state),  # the default ledger lives in the user's state directory
        "PYTHONUNBUFFERED": "1",
    }
    params = StdioServerParameters(command=command, args=entry["args"], env=env)
    async with Client(params, read_timeout_seconds=30) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert {"charge_card", "get_operation_status", "list_operations"} <= names
        result = await client.call_tool("charge_card", charge("desktop-1"))
        assert succeeded(result)["session"] == "default"
    assert (state / "commitgate" / "ledger.db").exists()
    assert Deployment(tmp_path, tmp_path, state, tmp_path / "sandbox.db").count("charges") == 1


async def test_stdio_calls_beyond_the_per_principal_limit_are_refused_and_nothing_runs(
    tmp_path: Path,
) -> None:
    """The per-call limit holds over stdio as over HTTP: the second call in flight is refused."""
    d = Deployment.create(tmp_path / "limited", respond_within="20s", max_concurrent_per_principal=1)
    gate = tmp_path / "gate"
    first = {"gate": str(gate), "label": "first", "idempotency_key": "limit-1"}
    second = {"gate": str(gate), "label": "second", "idempotency_key": "limit-2"}
    async with serve(d) as server:
        answers: dict[str, CallToolResult] = {}
        async with anyio.create_task_group() as tasks:

            async def call_first() -> None:
                answers["first"] = await server.call("gated_task", first, session="s")

            tasks.start_soon(call_first)
            await server.wait_for_state("s", "limit-1", {"RUNNING"})  # meta tools are never limited
            refused = await server.call("gated_task", second, session="s")
            assert error_code(refused) == "retries_exhausted"
            assert "max_concurrent_per_principal" in text_of(refused)
            assert d.count("tasks", idempotency_key="limit-2") == 0
            gate.touch()
        assert not answers["first"].is_error
        # the refused call left nothing behind: once the first is done, the same key runs
        assert not (await server.call("gated_task", second, session="s")).is_error
    assert d.count("tasks", idempotency_key="limit-1") == d.count("tasks", idempotency_key="limit-2") == 1
