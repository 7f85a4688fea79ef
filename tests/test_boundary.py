"""The commit boundary per idempotency class, counting effects in a SQLite system of record.

Every test of a side-effecting path asserts the exact number of effects the
system of record holds and how often the tool was really called.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from support.boundary import (
    KEYED_CLASSES,
    Crash,
    FakeClock,
    ScriptedTool,
    SystemOfRecord,
    call_request,
    effect_of,
    guarded,
    make_boundary,
)

from commitgate.server.core.classes import retry_advice
from commitgate.server.core.requests import Answer
from commitgate.server.core.retry import Backoff
from commitgate.server.ledger.base import (
    AttemptStart,
    ClaimKind,
    ClaimRequest,
    Ledger,
    LedgerUnavailable,
    OperationFilter,
)
from commitgate.server.model.facts import ErrorCode, IdempotencyClass, RetryAdvice, State
from commitgate.server.model.records import Operation
from commitgate.server.policy.models import RetryPolicy

keyed = pytest.mark.parametrize("cls", KEYED_CLASSES)


class Rig:
    """One guarded tool on one boundary, and what the test needs to look at."""

    def __init__(
        self,
        ledger: Ledger,
        record: SystemOfRecord,
        cls: str,
        script: list[str] | None = None,
        status: list[str] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        server: dict[str, Any] | None = None,
        **policy: Any,
    ) -> None:
        self.ledger, self.record = ledger, record
        self.source = ScriptedTool(record, script, status, dedup=bool(policy.get("forwards_key")))
        self.tool = guarded("charge", cls, self.source, **policy)
        self.boundary = make_boundary(ledger, [self.tool], clock=clock, **(server or {}))

    async def call(self, key: str | None = "k1", amount: int = 500, **kw: Any) -> Answer:
        return await self.boundary.call(call_request(self.tool, key, amount, **kw))

    async def op(self, key: str = "k1") -> Operation:
        found = await self.ledger.get("alice", "s1", key)
        assert found is not None
        return found

    async def events(self, key: str = "k1") -> list[str]:
        return [entry.event for entry in await self.ledger.history((await self.op(key)).operation_id)]


def succeeded(answer: Answer, *, replayed: bool) -> str:
    """Assert a successful answer; return the effect it reports."""
    assert answer.error is None, answer.error and answer.error.message
    assert answer.replayed is replayed
    assert answer.operation is not None and answer.operation.state is State.SUCCEEDED
    effect = effect_of(answer.result)
    assert effect is not None
    return effect


def failed_with(answer: Answer, code: ErrorCode) -> Operation | None:
    assert answer.error is not None and answer.error.code is code, answer
    assert answer.result is None
    return answer.operation


# --- lost responses, client timeouts ------------------------------------------------------------


@pytest.mark.anyio
@keyed
async def test_a_lost_response_after_success_is_replayed(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["ok"])
    first = await rig.call()
    effect = succeeded(first, replayed=False)
    again = await rig.call()  # the client never saw `first` and retries with the same key
    assert succeeded(again, replayed=True) == effect
    assert again.result == first.result
    assert again.operation is not None and first.operation is not None
    assert again.operation.operation_id == first.operation.operation_id
    assert (record.count(), rig.source.calls) == (1, 1)


@pytest.mark.anyio
@keyed
async def test_a_client_that_gives_up_does_not_stop_the_work(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["hold_after"])
    request = asyncio.create_task(rig.call())
    await rig.source.entered.wait()  # the effect is applied; the answer is not back yet
    request.cancel()  # the client times out: its request is cancelled
    with pytest.raises(asyncio.CancelledError):
        await request
    assert record.count() == 1
    rig.source.release()
    await rig.boundary.drain()
    assert (await rig.op()).state is State.SUCCEEDED
    succeeded(await rig.call(), replayed=True)
    assert (record.count(), rig.source.calls) == (1, 1)


@pytest.mark.anyio
@keyed
async def test_respond_within_answers_in_progress_while_the_work_lands(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["hold_before"], server={"respond_within": "100ms"})
    op = failed_with(await rig.call(), ErrorCode.OPERATION_IN_PROGRESS)
    assert op is not None and op.state is State.RUNNING and record.count() == 0
    rig.source.release()
    await rig.boundary.drain()
    stored = await rig.op()
    assert stored.state is State.SUCCEEDED and effect_of(stored.result) is not None
    assert succeeded(await rig.call(), replayed=True) == effect_of(stored.result)
    assert (record.count(), rig.source.calls) == (1, 1)


TIMEOUT_AFTER_EFFECT = {
    "key-required": ErrorCode.OPERATION_OUTCOME_UNKNOWN,
    "key-and-status-check": None,  # reconciled: the status check finds the effect
    "compensable": ErrorCode.OPERATION_OUTCOME_UNKNOWN,
}


@pytest.mark.anyio
@keyed
@pytest.mark.parametrize("kind", ["timeout_after", "ambiguous_after", "error_after"])
async def test_an_ambiguous_failure_after_the_effect_is_never_rerun(
    ledger: Ledger, record: SystemOfRecord, cls: str, kind: str
) -> None:
    rig = Rig(ledger, record, cls, [kind], timeout="200ms")
    answer = await rig.call()
    code = TIMEOUT_AFTER_EFFECT[cls]
    if code is None:
        effect = succeeded(answer, replayed=True)  # not produced by the execution: found by reconciliation
        assert record.effect_ids() == [effect]
        op = await rig.op()
        assert op.reconciliation is not None and op.reconciliation.verdict == "found"
        assert succeeded(await rig.call(), replayed=True) == effect
    else:
        failed = failed_with(answer, code)
        assert failed is not None and failed.state is State.UNKNOWN
        failed_with(await rig.call(), code)  # a retry executes nothing
    assert (record.count(), rig.source.calls) == (1, 1)


@pytest.mark.anyio
@pytest.mark.parametrize("cls", ["key-required", "compensable"])
async def test_an_ambiguous_failure_before_the_effect_still_stays_unknown(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["ambiguous_before"])
    assert failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN) is not None
    failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    assert (record.count(), rig.source.calls) == (0, 1)
    op = await rig.op()
    assert retry_advice(op.idempotency_class, op.state, False, False) is RetryAdvice.DO_NOT_RETRY


@pytest.mark.anyio
async def test_forwards_key_retries_an_ambiguous_failure_with_the_same_key(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    rig = Rig(ledger, record, "key-required", ["ambiguous_after", "ok"], forwards_key=True)
    effect = succeeded(await rig.call(), replayed=False)
    assert [ctx.idempotency_key for ctx in rig.source.contexts] == ["k1", "k1"]
    assert (record.count(), rig.source.calls) == (1, 2)  # the downstream deduplicated the second request
    assert effect_of((await rig.op()).result) == effect


@pytest.mark.anyio
@pytest.mark.parametrize("calls", [["ambiguous_after", "retryable"], ["ambiguous_after"]])
async def test_forwards_key_never_calls_a_possibly_applied_operation_retryable(
    ledger: Ledger, record: SystemOfRecord, calls: list[str]
) -> None:
    """An ambiguous attempt that may have applied, then transient failures: UNKNOWN, not FAILED_RETRYABLE."""
    attempts = len(calls)
    script = [*calls, *["retryable"] * attempts]
    rig = Rig(ledger, record, "key-required", script, forwards_key=True, retry={"attempts": attempts})
    answer = await rig.call()
    first = failed_with(answer, ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    assert (
        answer.error is not None and "same idempotency_key 'k1' is safe" in answer.error.message
    )  # as advised
    assert first is not None and (first.state, first.attempts) == (State.UNKNOWN, attempts)
    # the next call re-runs (the downstream dedups on the key) and only fails transiently: still UNKNOWN
    op = failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    assert op is not None and (op.state, op.attempts) == (State.UNKNOWN, 2 * attempts)
    assert record.count() == 1
    effect = succeeded(await rig.call(), replayed=False)  # re-running with the same key is still safe
    assert record.effect_ids() == [effect]
    assert (record.count(), rig.source.calls) == (1, 2 * attempts + 1)


# --- failures before the effect, retries -----------------------------------------------------------


@pytest.mark.anyio
@keyed
async def test_a_failure_before_the_effect_is_retried_for_real_exactly_once(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["retryable", "retryable", "ok"])
    succeeded(await rig.call(), replayed=False)
    op = await rig.op()
    assert (op.attempts, op.fence) == (3, 3)
    assert [ctx.attempt for ctx in rig.source.contexts] == [1, 2, 3]
    assert {ctx.operation_id for ctx in rig.source.contexts} == {op.operation_id}
    assert (record.count(), rig.source.calls) == (1, 3)
    assert await rig.events() == ["claimed", "retry", "retry", "succeeded"]


@pytest.mark.anyio
@keyed
async def test_exhausted_retries_then_the_same_key_takes_over_with_the_next_fence(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["retryable", "retryable", "ok"], retry={"attempts": 2})
    op = failed_with(await rig.call(), ErrorCode.RETRIES_EXHAUSTED)
    assert op is not None and (op.state, op.attempts, op.fence) == (State.FAILED_RETRYABLE, 2, 2)
    assert retry_advice(op.idempotency_class, op.state, False, False) is RetryAdvice.SAFE_TO_RETRY_SAME_KEY
    assert record.count() == 0
    succeeded(await rig.call(), replayed=False)
    op = await rig.op()
    assert (op.state, op.attempts, op.fence) == (State.SUCCEEDED, 3, 3)
    succeeded(await rig.call(), replayed=True)
    assert (record.count(), rig.source.calls) == (1, 3)
    history = await ledger.history(op.operation_id)
    assert [(e.event, e.fence) for e in history] == [
        ("claimed", 1),
        ("retry", 2),
        ("retries_exhausted", 2),
        ("retry_claimed", 3),
        ("succeeded", 3),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("attempts", [1, 4])
async def test_retry_attempts_counts_every_attempt_the_first_included(
    ledger: Ledger, record: SystemOfRecord, attempts: int
) -> None:
    rig = Rig(ledger, record, "key-required", retry={"attempts": attempts})
    rig.source.default = "retryable"
    op = failed_with(await rig.call(), ErrorCode.RETRIES_EXHAUSTED)
    assert op is not None and op.attempts == attempts
    assert (record.count(), rig.source.calls) == (0, attempts)


@pytest.mark.anyio
async def test_retry_after_beyond_the_deadline_stops_retrying(ledger: Ledger, record: SystemOfRecord) -> None:
    rig = Rig(
        ledger, record, "key-required", ["retry_after:100", "ok"], retry={"attempts": 3, "deadline": "5s"}
    )
    op = failed_with(await rig.call(), ErrorCode.RETRIES_EXHAUSTED)
    assert op is not None and op.state is State.FAILED_RETRYABLE
    assert (record.count(), rig.source.calls) == (0, 1)


@pytest.mark.anyio
async def test_retry_after_is_waited_before_the_next_attempt(
    ledger: Ledger, record: SystemOfRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def spy(delay: float, result: Any = None) -> Any:
        slept.append(delay)
        return await real_sleep(0, result)

    monkeypatch.setattr(asyncio, "sleep", spy)
    rig = Rig(
        ledger, record, "key-required", ["retry_after:7.5", "ok"], retry={"initial": "10ms", "max": "10ms"}
    )
    succeeded(await rig.call(), replayed=False)
    assert 7.5 in slept
    assert (record.count(), rig.source.calls) == (1, 2)


def test_backoff_grows_to_its_cap_with_full_jitter_and_honours_retry_after() -> None:
    fixed = Backoff(RetryPolicy(initial=1.0, max=4.0, multiplier=2.0, jitter="none"), random.Random(1))
    assert [fixed.delay(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 4.0]
    assert fixed.delay(1, retry_after=9.0) == 9.0
    assert fixed.delay(3, retry_after=0.5) == 4.0  # Retry-After is a floor, not a ceiling
    jittered = Backoff(RetryPolicy(initial=1.0, max=4.0, multiplier=2.0, jitter="full"), random.Random(7))
    delays = [jittered.delay(3) for _ in range(200)]
    assert all(0.0 <= d <= 4.0 for d in delays) and len(set(delays)) > 100


@pytest.mark.anyio
@keyed
async def test_a_permanent_failure_is_recorded_and_replayed(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["permanent", "ok"])
    op = failed_with(await rig.call(), ErrorCode.OPERATION_FAILED)
    assert op is not None and op.state is State.FAILED_FINAL
    assert op.error is not None and op.error.message == "card declined"
    again = failed_with(await rig.call(), ErrorCode.OPERATION_FAILED)
    assert again is not None and again.operation_id == op.operation_id
    assert (record.count(), rig.source.calls) == (0, 1)


# --- the status check -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_status_check_not_found_executes_again_at_once(ledger: Ledger, record: SystemOfRecord) -> None:
    rig = Rig(ledger, record, "key-and-status-check", ["ambiguous_before", "ok"])
    succeeded(await rig.call(), replayed=False)
    op = await rig.op()
    assert (op.attempts, rig.source.status_calls) == (2, 1)
    assert (record.count(), rig.source.calls) == (1, 2)


@pytest.mark.anyio
async def test_forwards_key_retries_with_the_same_key_when_the_status_check_cannot_tell(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    """A 500 after the effect, a status check that cannot tell: the downstream dedups, so go again."""
    rig = Rig(
        ledger,
        record,
        "key-and-status-check",
        ["ambiguous_after", "ambiguous_after", "ok"],
        ["fail", "fail"],
        forwards_key=True,
        retry={"attempts": 3},
    )
    effect = succeeded(await rig.call(), replayed=False)
    assert [ctx.idempotency_key for ctx in rig.source.contexts] == ["k1", "k1", "k1"]
    assert (record.count(), rig.source.calls, rig.source.status_calls) == (1, 3, 2)
    assert record.effect_ids() == [effect]
    assert (await rig.op()).attempts == 3


@pytest.mark.anyio
async def test_forwards_key_status_check_tool_left_unknown_reruns_on_the_next_call(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    script = ["ambiguous_after", "ok"]
    rig = Rig(
        ledger,
        record,
        "key-and-status-check",
        script,
        ["fail", "fail"],
        forwards_key=True,
        retry={"attempts": 1},
    )
    op = failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    assert op is not None and op.state is State.UNKNOWN
    assert retry_advice(op.idempotency_class, op.state, True, False) is RetryAdvice.SAFE_TO_RETRY_SAME_KEY
    effect = succeeded(await rig.call(), replayed=False)  # cannot tell again: re-run, deduplicated downstream
    assert record.effect_ids() == [effect]
    assert (record.count(), rig.source.calls, rig.source.status_calls) == (1, 2, 2)


@pytest.mark.anyio
async def test_status_check_that_fails_leaves_unknown_until_a_later_check_finds_it(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    rig = Rig(ledger, record, "key-and-status-check", ["ambiguous_after"], ["fail"])
    op = failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    assert op is not None and op.state is State.UNKNOWN
    noted = (await rig.op()).reconciliation
    assert noted is not None and noted.verdict == "cannot_tell"
    effect = succeeded(await rig.call(), replayed=True)  # the retry reconciles: found
    assert effect == effect_of((await rig.op()).result)
    assert (record.count(), rig.source.calls, rig.source.status_calls) == (1, 1, 2)
    assert "reconciled_found" in await rig.events()


@pytest.mark.anyio
async def test_status_check_that_fails_then_finds_nothing_lets_the_retry_run(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    rig = Rig(ledger, record, "key-and-status-check", ["ambiguous_before", "ok"], ["fail", "fail"])
    failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)  # still cannot tell: nothing runs
    assert (record.count(), rig.source.calls) == (0, 1)
    succeeded(await rig.call(), replayed=False)  # now the check says "not found": run with the same key
    op = await rig.op()
    assert (op.state, op.attempts, op.fence) == (State.SUCCEEDED, 2, 2)
    assert (record.count(), rig.source.calls) == (1, 2)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "status", "state"),
    [
        ("ambiguous_after", "lookup", State.SUCCEEDED),
        ("ambiguous_before", "lookup", State.FAILED_RETRYABLE),
        ("ambiguous_after", "fail", State.UNKNOWN),
    ],
)
async def test_a_poll_reconciles_unknown(
    ledger: Ledger, record: SystemOfRecord, kind: str, status: str, state: State
) -> None:
    rig = Rig(ledger, record, "key-and-status-check", [kind, "ok"], ["fail", status])
    failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    polled = await rig.boundary.poll(await rig.op())
    assert polled.state is state
    assert (await rig.op()).state is state
    effects = 1 if kind == "ambiguous_after" else 0
    assert (record.count(), rig.source.calls) == (effects, 1)
    if state is State.FAILED_RETRYABLE:  # "not found" on a poll: safe to run again with the same key
        assert (
            retry_advice(polled.idempotency_class, polled.state, False, False)
            is RetryAdvice.SAFE_TO_RETRY_SAME_KEY
        )
        succeeded(await rig.call(), replayed=False)
        assert (record.count(), rig.source.calls) == (1, 2)


# --- concurrency ------------------------------------------------------------------------------------


@pytest.mark.anyio
@keyed
async def test_concurrent_duplicates_in_one_process_execute_once(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["hold_before"])
    calls = [asyncio.create_task(rig.call()) for _ in range(8)]
    await rig.source.entered.wait()
    await asyncio.sleep(0.05)  # let the duplicates find the operation running
    rig.source.release()
    answers = await asyncio.gather(*calls)
    effects = {succeeded(a, replayed=a.replayed) for a in answers}
    assert len(effects) == 1
    assert [a.replayed for a in answers].count(False) == 1
    assert (record.count(), rig.source.calls) == (1, 1)


@pytest.mark.anyio
@keyed
async def test_a_duplicate_on_another_boundary_waits_for_the_outcome(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    first = Rig(ledger, record, cls, ["hold_before"])
    second = Rig(ledger, record, cls, ["ok"])
    second.boundary.owner = "otherhost:1:x"
    owner = asyncio.create_task(first.call())
    await first.source.entered.wait()
    duplicate = asyncio.create_task(second.call())
    await asyncio.sleep(0.05)
    first.source.release()
    effect = succeeded(await owner, replayed=False)
    assert succeeded(await duplicate, replayed=True) == effect
    assert (record.count(), first.source.calls, second.source.calls) == (1, 1, 0)


@pytest.mark.anyio
async def test_a_duplicate_gets_in_progress_after_the_bounded_wait(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    first = Rig(ledger, record, "key-required", ["hold_before"])
    second = Rig(ledger, record, "key-required", ["ok"], server={"in_progress_wait": "100ms"})
    second.boundary.owner = "otherhost:1:x"
    owner = asyncio.create_task(first.call())
    await first.source.entered.wait()
    op = failed_with(await second.call(), ErrorCode.OPERATION_IN_PROGRESS)
    assert op is not None and op.state is State.RUNNING
    first.source.release()
    succeeded(await owner, replayed=False)
    assert (record.count(), first.source.calls, second.source.calls) == (1, 1, 0)


# --- keys ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
@keyed
async def test_the_same_key_with_other_arguments_or_another_tool_is_refused(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls, ["ok"])
    other_source = ScriptedTool(record)
    other_tool = guarded("refund", cls, other_source)
    rig.boundary.tools = {rig.tool.name: rig.tool, other_tool.name: other_tool}
    succeeded(await rig.call(amount=500), replayed=False)
    refused = failed_with(await rig.call(amount=999), ErrorCode.IDEMPOTENCY_KEY_REUSED)
    assert refused is not None and refused.state is State.SUCCEEDED
    other = await rig.boundary.call(call_request(other_tool, "k1", 500))
    failed_with(other, ErrorCode.IDEMPOTENCY_KEY_REUSED)
    assert other.error is not None and "charge" in other.error.message
    assert (record.count(), rig.source.calls, other_source.calls) == (1, 1, 0)


@pytest.mark.anyio
@keyed
async def test_keys_are_scoped_by_session_and_principal(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls)
    for session, principal in (("s1", "alice"), ("s2", "alice"), ("s1", "bob")):
        succeeded(await rig.call(session=session, principal=principal), replayed=False)
    assert (record.count(), rig.source.calls) == (3, 3)


@pytest.mark.anyio
@keyed
async def test_a_keyed_tool_without_a_key_executes_nothing(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    rig = Rig(ledger, record, cls)
    failed_with(await rig.call(key=None), ErrorCode.IDEMPOTENCY_KEY_REQUIRED)
    assert (record.count(), rig.source.calls) == (0, 0)


class BrokenLedger:
    """A ledger whose every write fails, as a full disk or a lost database would."""

    def __init__(self, inner: Ledger) -> None:
        self.inner = inner

    async def claim(self, request: ClaimRequest, now: float) -> Any:
        raise LedgerUnavailable("disk I/O error")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.anyio
@keyed
async def test_an_unwritable_ledger_fails_closed(ledger: Ledger, record: SystemOfRecord, cls: str) -> None:
    rig = Rig(BrokenLedger(ledger), record, cls)
    answer = await rig.call()
    assert failed_with(answer, ErrorCode.LEDGER_UNAVAILABLE) is None
    assert (record.count(), rig.source.calls) == (0, 0)


# --- retention ----------------------------------------------------------------------------------------


@pytest.mark.anyio
@keyed
async def test_an_expired_record_is_forgotten(ledger: Ledger, record: SystemOfRecord, cls: str) -> None:
    clock = FakeClock()
    rig = Rig(ledger, record, cls, clock=clock, retention="60s")
    first = succeeded(await rig.call(), replayed=False)
    clock.advance(59)
    assert succeeded(await rig.call(), replayed=True) == first
    old_id = (await rig.op()).operation_id
    clock.advance(2)  # past retention: the key is new again
    second = succeeded(await rig.call(amount=700), replayed=False)
    assert second != first and (await rig.op()).operation_id != old_id
    assert (record.count(), rig.source.calls) == (2, 2)


@pytest.mark.anyio
@pytest.mark.parametrize("cls", ["key-required", "compensable"])
async def test_unknown_outlives_retention(ledger: Ledger, record: SystemOfRecord, cls: str) -> None:
    clock = FakeClock()
    rig = Rig(ledger, record, cls, ["ambiguous_after"], clock=clock, retention="60s")
    failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    clock.advance(3600)
    assert await ledger.purge(clock()) == 0
    failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    assert (record.count(), rig.source.calls) == (1, 1)


# --- leases, crashes, fencing -------------------------------------------------------------------------


CRASH_THEN_RETRY = {
    ("key-required", "crash_after"): (ErrorCode.OPERATION_OUTCOME_UNKNOWN, 1),
    ("key-required", "crash_before"): (ErrorCode.OPERATION_OUTCOME_UNKNOWN, 0),
    ("compensable", "crash_after"): (ErrorCode.OPERATION_OUTCOME_UNKNOWN, 1),
    ("compensable", "crash_before"): (ErrorCode.OPERATION_OUTCOME_UNKNOWN, 0),
    ("key-and-status-check", "crash_after"): (None, 1),  # reconciled: found
    ("key-and-status-check", "crash_before"): (None, 1),  # not found: runs again, once
}


@pytest.mark.anyio
@keyed
@pytest.mark.parametrize("crash", ["crash_after", "crash_before"])
async def test_a_crash_before_recording_is_never_rerun_blindly(
    ledger: Ledger, record: SystemOfRecord, cls: str, crash: str
) -> None:
    clock = FakeClock()
    rig = Rig(ledger, record, cls, [crash, "ok"], clock=clock, server={"in_progress_wait": "0s"})
    with pytest.raises(Crash):
        await rig.call()
    assert (await rig.op()).state is State.RUNNING  # nothing was recorded after the claim
    failed_with(await rig.call(), ErrorCode.OPERATION_IN_PROGRESS)  # the lease is still live
    clock.advance(11)  # the lease (10s) runs out
    code, effects = CRASH_THEN_RETRY[(cls, crash)]
    answer = await rig.call()
    if code is None:
        succeeded(answer, replayed=crash == "crash_after")
        assert (await rig.op()).state is State.SUCCEEDED
    else:
        failed = failed_with(answer, code)
        assert failed is not None and failed.state is State.UNKNOWN
        assert failed.error is not None and failed.error.code == "lease_expired"
    assert record.count() == effects
    assert rig.source.calls == 1 + (crash == "crash_before" and cls == "key-and-status-check")


@pytest.mark.anyio
@keyed
async def test_an_owner_that_outlived_its_lease_still_records_how_it_ended(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    clock = FakeClock()
    rig = Rig(ledger, record, cls, ["hold_after"], clock=clock)
    late = asyncio.create_task(rig.call())
    await rig.source.entered.wait()  # the effect is applied; the owner stalls before recording it
    clock.advance(11)
    expired = await ledger.expire_leases(clock())  # the periodic sweep
    assert [op.state for op in expired] == [State.UNKNOWN]
    rig.source.release()
    effect = succeeded(await late, replayed=False)  # it ran in this very call
    op = await rig.op()
    assert op.state is State.SUCCEEDED and effect_of(op.result) == effect and op.error is None
    assert op.reconciliation is not None and op.reconciliation.by == "owner"
    assert await rig.events() == ["claimed", "lease_expired", "late_outcome"]
    assert succeeded(await rig.call(), replayed=True) == effect  # a retry replays it, never runs it
    assert (record.count(), rig.source.calls) == (1, 1)


@pytest.mark.anyio
async def test_a_status_check_does_not_conclude_while_the_attempt_runs_after_a_wall_clock_step(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    clock = FakeClock()  # the wall clock: it steps 11 s forward, past the lease
    rig = Rig(ledger, record, "key-and-status-check", ["hold_before"], ["none"], clock=clock)
    late = asyncio.create_task(rig.call())
    await asyncio.sleep(0.05)  # the owner is inside the tool, before its effect
    clock.advance(11)
    await ledger.expire_leases(clock())
    polled = await rig.boundary.poll(await rig.op())  # the check finds nothing yet: that proves nothing
    assert polled.state is State.UNKNOWN
    assert polled.reconciliation is not None and polled.reconciliation.verdict == "cannot_tell"
    again = await rig.call()  # a call with the same key does not run it again either
    assert again.error is not None and again.error.code is ErrorCode.OPERATION_IN_PROGRESS
    rig.source.release()  # the owner's attempt lands after all
    effect = succeeded(await late, replayed=False)
    assert (await rig.op()).state is State.SUCCEEDED
    assert succeeded(await rig.call(), replayed=True) == effect
    assert (record.count(), rig.source.calls) == (1, 1)


@pytest.mark.anyio
@keyed
async def test_a_late_ambiguous_outcome_leaves_unknown_as_it_is(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    clock = FakeClock()
    rig = Rig(ledger, record, cls, ["held:ambiguous_after"], ["fail"], clock=clock)
    late = asyncio.create_task(rig.call())
    await rig.source.entered.wait()
    clock.advance(11)
    await ledger.expire_leases(clock())
    rig.source.release()
    await late
    op = await rig.op()
    assert op.state is State.UNKNOWN and op.error is not None and op.error.code == "lease_expired"
    assert "late_outcome" not in await rig.events()
    assert record.count() == 1


@pytest.mark.anyio
@pytest.mark.parametrize(("cls", "forwards_key"), [("key-and-status-check", False), ("key-required", True)])
async def test_a_stale_owner_cannot_record_after_a_newer_attempt(
    ledger: Ledger, record: SystemOfRecord, cls: str, forwards_key: bool
) -> None:
    clock = FakeClock()
    stale = Rig(ledger, record, cls, ["stale"], clock=clock, forwards_key=forwards_key)
    # The first owner stalls past its attempt's own deadline too (a process frozen that long):
    # by the ledger's clock its attempt is over, so the newer one may take it.
    newer = Rig(AttemptsOver(ledger), record, cls, ["hold_after"], clock=clock, forwards_key=forwards_key)
    newer.boundary.owner = "otherhost:2:y"
    stale_call = asyncio.create_task(stale.call())
    await stale.source.entered.wait()
    clock.advance(11)  # the first owner stalls past its lease
    newer_call = asyncio.create_task(newer.call())
    await newer.source.entered.wait()
    taken = await stale.op()
    assert (taken.state, taken.fence, taken.lease_owner) == (State.RUNNING, 2, "otherhost:2:y")
    stale.source.release()  # the stale owner now claims success for fence 1
    stale_answer = await stale_call
    assert stale_answer.error is not None or stale_answer.replayed
    assert (await stale.op()).fence == 2 and (await stale.op()).state is State.RUNNING
    newer.source.release()
    effect = succeeded(await newer_call, replayed=False)
    op = await stale.op()
    assert (op.state, op.fence, effect_of(op.result)) == (State.SUCCEEDED, 2, effect)
    assert record.count() == 1
    history = await ledger.history(op.operation_id)
    assert [e.fence for e in history if e.to_state == "SUCCEEDED"] == [2]


class AttemptsOver:
    """A ledger by whose clock every attempt was taken long ago (past any lease and timeout)."""

    def __init__(self, inner: Ledger) -> None:
        self.inner = inner

    async def attempt_start(self, operation_id: str, fence: int) -> AttemptStart | None:
        start = await self.inner.attempt_start(operation_id, fence)
        return None if start is None else AttemptStart(start.owner, math.inf)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class StaleReads:
    """A ledger whose reads of one state are delivered late: what a slow replica or a busy process sees."""

    def __init__(self, inner: Ledger, late_state: State) -> None:
        self.inner, self.late_state = inner, late_state
        self.read_late = asyncio.Event()
        self.deliver = asyncio.Event()

    async def get_by_id(self, principal: str | None, operation_id: str) -> Operation | None:
        op = await self.inner.get_by_id(principal, operation_id)
        if op is not None and op.state is self.late_state and not self.deliver.is_set():
            self.read_late.set()
            await self.deliver.wait()
        return op

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.anyio
@pytest.mark.parametrize("cls", ["key-required", "key-and-status-check"])
async def test_a_rerun_decided_on_a_stale_read_never_reexecutes(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    """C saw FAILED_RETRYABLE; before it acts, B re-runs it into UNKNOWN with the effect applied."""
    first = Rig(ledger, record, cls, ["held:retryable"], retry={"attempts": 1})
    late = StaleReads(ledger, State.FAILED_RETRYABLE)
    waiter = Rig(late, record, cls, ["ok"], ["fail"])
    other = Rig(ledger, record, cls, ["ambiguous_after"], ["fail"])
    waiter.boundary.owner, other.boundary.owner = "hostc:1:c", "hostb:1:b"
    running = asyncio.create_task(first.call())
    await first.source.entered.wait()
    waiting = asyncio.create_task(waiter.call())  # finds it RUNNING elsewhere: polls the ledger
    await asyncio.sleep(0.02)
    first.source.release()
    failed_with(await running, ErrorCode.RETRIES_EXHAUSTED)
    await late.read_late.wait()  # the waiter has read FAILED_RETRYABLE; its answer is still on the way
    failed_with(await other.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)  # re-run: applied, answer lost
    assert record.count() == 1 and (await first.op()).state is State.UNKNOWN
    late.deliver.set()
    answer = await waiting
    assert answer.error is not None and answer.error.code in (
        ErrorCode.OPERATION_OUTCOME_UNKNOWN,
        ErrorCode.OPERATION_IN_PROGRESS,
    )
    assert (record.count(), waiter.source.calls) == (1, 0)


@pytest.mark.anyio
async def test_a_poll_not_found_does_not_overwrite_a_newer_attempt(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    """The poll's status check says "not found", but before it records that, a newer attempt applied."""
    rig = Rig(ledger, record, "key-and-status-check", ["ambiguous_before"], ["fail"])
    failed_with(await rig.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)
    poller = Rig(ledger, record, "key-and-status-check", [], ["held_lookup"])
    poll = asyncio.create_task(poller.boundary.poll(await rig.op()))
    await poller.source.entered.wait()  # looked: nothing there yet
    other = Rig(ledger, record, "key-and-status-check", ["ambiguous_after"], ["lookup", "fail"])
    other.boundary.owner = "hostb:1:b"
    failed_with(await other.call(), ErrorCode.OPERATION_OUTCOME_UNKNOWN)  # not found, re-run, applied, lost
    assert record.count() == 1
    poller.source.release()
    polled = await poll
    assert polled.state is State.UNKNOWN and polled.fence == 2
    effect = succeeded(await rig.call(), replayed=True)  # the next call reconciles: found
    assert record.effect_ids() == [effect]
    assert (record.count(), rig.source.calls + other.source.calls) == (1, 2)


# --- lease expiry at start-up, periodically, renewal -----------------------------------------------------


def running_request(step: str, owner: str, lease: float) -> ClaimRequest:
    return ClaimRequest(
        "alice", "s1", step, "charge", IdempotencyClass.KEY_REQUIRED, "fp", "{}", owner, lease, 86400.0
    )


@pytest.mark.anyio
async def test_running_expires_leases_at_start_up_and_periodically(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    rig = Rig(ledger, record, "key-required")
    before = await ledger.claim(running_request("before", "otherhost:1:x", 0.001), time.time() - 10)
    assert before.kind is ClaimKind.NEW
    async with rig.boundary.running(sweep_every=0.02):
        assert (await rig.op("before")).state is State.UNKNOWN  # start-up sweep, before any wait
        await ledger.claim(running_request("during", "otherhost:1:x", 0.001), time.time() - 10)
        for _ in range(250):
            if (await rig.op("during")).state is State.UNKNOWN:
                break
            await asyncio.sleep(0.02)
        assert (await rig.op("during")).state is State.UNKNOWN


@pytest.mark.anyio
async def test_running_renews_the_lease_of_work_in_flight(ledger: Ledger, record: SystemOfRecord) -> None:
    rig = Rig(ledger, record, "key-required", ["hold_before"], server={"lease": "1s"})
    async with rig.boundary.running():  # renews every lease / 3
        call = asyncio.create_task(rig.call())
        await rig.source.entered.wait()
        await asyncio.sleep(1.5)  # longer than the lease: only renewals keep it alive
        assert await ledger.expire_leases(time.time()) == []
        rig.source.release()
        succeeded(await call, replayed=False)
    assert (record.count(), rig.source.calls) == (1, 1)


@pytest.mark.anyio
async def test_a_poll_expires_a_lease_whose_owner_is_known_dead(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = f"{socket.gethostname()}:{child.pid}:dead"
    rig = Rig(ledger, record, "key-required")
    claim = await ledger.claim(running_request("k1", dead, 3600.0), time.time())
    polled = await rig.boundary.poll(claim.operation)
    assert polled.state is State.UNKNOWN and (await rig.op()).state is State.UNKNOWN
    assert polled.error is not None and polled.error.code == "lease_expired"


# --- safe-retry ----------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_safe_retry_is_retried_automatically_and_never_recorded(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    rig = Rig(ledger, record, "safe-retry", ["ambiguous_before", "retryable", "ok"])
    answer = await rig.call(key="ignored")
    assert answer.error is None and answer.operation is None and not answer.replayed
    assert (record.count(), rig.source.calls) == (1, 3)
    assert [ctx.attempt for ctx in rig.source.contexts] == [1, 2, 3]
    assert await ledger.find(OperationFilter(principal=None)) == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("script", "code", "calls"),
    [(["permanent"], ErrorCode.OPERATION_FAILED, 1), (["retryable"] * 3, ErrorCode.RETRIES_EXHAUSTED, 3)],
)
async def test_safe_retry_failures_answer_without_an_operation(
    ledger: Ledger, record: SystemOfRecord, script: list[str], code: ErrorCode, calls: int
) -> None:
    rig = Rig(ledger, record, "safe-retry", script)
    assert failed_with(await rig.call(key=None), code) is None
    assert (record.count(), rig.source.calls) == (0, calls)
    assert sum((await ledger.counts()).states.values()) == 0


class SlowClaims:
    """A ledger whose claims come back late, by a monotonic clock the test moves: a stalled owner."""

    def __init__(self, inner: Ledger, stall: Callable[[], None]) -> None:
        self.inner, self.stall = inner, stall

    async def claim(self, request: ClaimRequest, now: float) -> Any:
        claim = await self.inner.claim(request, now)
        self.stall()
        return claim

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.anyio
async def test_an_owner_whose_lease_ran_out_before_its_attempt_never_starts_it(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    """Another process may take the operation over once the lease is out: the stalled owner fences itself."""
    elapsed = [0.0]
    stalled = SlowClaims(ledger, lambda: elapsed.__setitem__(0, elapsed[0] + 11))
    rig = Rig(stalled, record, "key-required", ["ok"], retry={"attempts": 1})
    rig.boundary.monotonic = lambda: elapsed[0]
    answer = await rig.call()
    assert answer.error is not None and answer.error.code is ErrorCode.RETRIES_EXHAUSTED
    assert (await rig.op()).state is State.FAILED_RETRYABLE  # certainly not applied: nothing was sent
    assert (rig.source.calls, record.count()) == (0, 0)
