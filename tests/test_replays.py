"""Replays of final outcomes answered from memory: no ledger read, and never a stale answer.

Every test counts the effects in the system of record and the claims that reached the ledger.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from support.boundary import ScriptedTool, SystemOfRecord, call_request, effect_of, guarded, make_boundary

from commitgate.server.core.boundary import CommitBoundary
from commitgate.server.core.replays import FinalOutcomes
from commitgate.server.core.requests import Answer
from commitgate.server.ledger.base import ClaimRequest, Ledger, Transition
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import ErrorCode, IdempotencyClass, State
from commitgate.server.model.records import Operation, ToolResult


class CountingLedger:
    """The ledger, counting the claims that reach it."""

    def __init__(self, inner: Ledger) -> None:
        self.inner = inner
        self.claims = 0

    async def claim(self, request: ClaimRequest, now: float) -> Any:
        self.claims += 1
        return await self.inner.claim(request, now)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def boundary_on(ledger: Ledger, source: ScriptedTool, cls: str) -> tuple[CommitBoundary, CountingLedger]:
    counting = CountingLedger(ledger)
    boundary = make_boundary(counting, [guarded("charge", cls, source)])
    return boundary, counting


async def charge(boundary: CommitBoundary, key: str = "k1", amount: int = 500, **kw: Any) -> Answer:
    return await boundary.call(call_request(boundary.tools["charge"], key, amount, **kw))


def effect(answer: Answer) -> str | None:
    assert answer.error is None, answer.error and answer.error.message
    return effect_of(answer.result)


@pytest.mark.anyio
@pytest.mark.parametrize("cls", ["key-required", "key-and-status-check"])
async def test_a_replay_of_a_final_outcome_reads_no_ledger(
    ledger: Ledger, record: SystemOfRecord, cls: str
) -> None:
    boundary, counting = boundary_on(ledger, ScriptedTool(record), cls)
    first = await charge(boundary)
    replays = [await charge(boundary) for _ in range(3)]
    assert counting.claims == 1
    assert all(answer.replayed and effect(answer) == effect(first) for answer in replays)
    assert replays[0].operation == first.operation
    assert record.count() == 1


@pytest.mark.anyio
async def test_a_permanent_failure_is_replayed_from_memory(ledger: Ledger, record: SystemOfRecord) -> None:
    source = ScriptedTool(record, ["permanent"])
    boundary, counting = boundary_on(ledger, source, "key-required")
    first, again = await charge(boundary), await charge(boundary)
    assert first.error is not None and first.error.code is ErrorCode.OPERATION_FAILED and not first.replayed
    assert again.error is not None and again.error.code is ErrorCode.OPERATION_FAILED and again.replayed
    assert (counting.claims, source.calls, record.count()) == (1, 1, 0)


@pytest.mark.anyio
async def test_an_outcome_another_process_recorded_is_read_once(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    elsewhere, _ = boundary_on(ledger, ScriptedTool(record), "key-required")
    here_source = ScriptedTool(record)
    here, counting = boundary_on(ledger, here_source, "key-required")
    first = await charge(elsewhere)
    replays = [await charge(here) for _ in range(3)]
    assert all(answer.replayed and effect(answer) == effect(first) for answer in replays)
    assert (counting.claims, here_source.calls, record.count()) == (1, 0, 1)


@pytest.mark.anyio
async def test_other_arguments_or_another_principal_never_match_the_memory(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    source = ScriptedTool(record)
    boundary, _ = boundary_on(ledger, source, "key-required")
    mine = effect(await charge(boundary))
    clash = await charge(boundary, amount=900)
    assert clash.error is not None and clash.error.code is ErrorCode.IDEMPOTENCY_KEY_REUSED
    theirs = effect(await charge(boundary, principal="bob"))
    assert theirs != mine and effect(await charge(boundary, principal="bob")) == theirs
    assert (record.count(principal="alice"), record.count(principal="bob"), source.calls) == (1, 1, 2)


@pytest.mark.anyio
async def test_a_compensated_operation_is_replayed_as_compensated(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    """Another process may compensate a compensable operation at any time: it is never kept."""
    boundary, counting = boundary_on(ledger, ScriptedTool(record), "compensable")
    first = await charge(boundary)
    assert first.operation is not None
    undone = Transition(State.COMPENSATED, frozenset({State.SUCCEEDED}), AuditEvent.COMPENSATED)
    assert await ledger.update(first.operation.operation_id, undone, time.time()) is not None
    again = await charge(boundary)
    assert again.replayed and again.operation is not None and again.operation.state is State.COMPENSATED
    assert (counting.claims, record.count()) == (2, 1)


@pytest.mark.anyio
async def test_an_unknown_operation_resolved_elsewhere_is_seen_at_once(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    """UNKNOWN is not final: an operator's `ops resolve` in another process must be seen."""
    boundary, _ = boundary_on(ledger, ScriptedTool(record, ["ambiguous_after"]), "key-required")
    first = await charge(boundary)
    assert first.error is not None and first.error.code is ErrorCode.OPERATION_OUTCOME_UNKNOWN
    assert first.operation is not None
    resolved = ToolResult.of({"effect_id": "resolved-by-operator"})
    change = Transition(State.SUCCEEDED, frozenset({State.UNKNOWN}), AuditEvent.RESOLVED, result=resolved)
    assert await ledger.update(first.operation.operation_id, change, time.time()) is not None
    again = await charge(boundary)
    assert again.replayed and effect(again) == "resolved-by-operator"
    assert record.count() == 1


def operation(step: str, *, state: State = State.SUCCEEDED, text: str = "ok", **fields: Any) -> Operation:
    values: dict[str, Any] = {
        "operation_id": f"op_{step}",
        "principal": "alice",
        "session": "s1",
        "step": step,
        "tool": "charge",
        "idempotency_class": IdempotencyClass.KEY_REQUIRED,
        "fingerprint": "fp",
        "state": state,
        "attempts": 1,
        "fence": 1,
        "arguments": {"amount": 5},
        "result": ToolResult.of({"text": text}),
        "created_at": 1.0,
        "updated_at": 2.0,
        "completed_at": 2.0,
        "expires_at": 100.0,
        "retention": 98.0,
        **fields,
    }
    return Operation(**values)


def test_the_memory_keeps_the_most_recently_used_and_only_small_final_outcomes() -> None:
    final = FinalOutcomes(capacity=2, max_chars=200)
    for step in ("a", "b"):
        final.remember(operation(step))
    assert final.get("alice", "s1", "a", now=50.0) is not None  # a is now the most recent
    final.remember(operation("c"))
    assert [final.get("alice", "s1", s, now=50.0) is not None for s in "abc"] == [True, False, True]
    final.remember(operation("big", text="x" * 300))
    final.remember(operation("running", state=State.RUNNING))
    final.remember(operation("unknown", state=State.UNKNOWN))
    final.remember(operation("undoable", idempotency_class=IdempotencyClass.COMPENSABLE))
    assert all(
        final.get("alice", "s1", s, now=50.0) is None for s in ("big", "running", "unknown", "undoable")
    )
    assert final.get("alice", "s1", "c", now=100.0) is None  # past retention, as in the ledger
    assert len(final) == 1


def test_timestamps_are_formatted_once_and_exactly_as_before() -> None:
    """A replay shows the same timestamps of its operation each time: they are formatted once."""
    from datetime import UTC, datetime

    from support.rounding_times import rounding_times

    from commitgate.server.model.records import iso

    # Edges of rounding to the microsecond (into the next second, halves) and many times of day.
    edges = (0.0, 1_700_000_000.0005, 1_700_000_000.9999996, 1_764_604_800.123456, 1_700_000_000.9999995)
    for ts in rounding_times(edges, seed=7):
        expected = datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        assert iso(ts) == expected, ts
    assert iso(None) is None
    ts = time.time()
    iso(ts)
    hits = iso.cache_info().hits
    assert iso(ts) == iso(ts)
    assert iso.cache_info().hits == hits + 2


def test_the_memory_measures_arguments_on_their_stored_encoding() -> None:
    """An operation from the ledger carries its arguments as stored: the size bound reads that text
    instead of encoding the arguments again on every call."""
    final = FinalOutcomes(capacity=4, max_chars=200)
    final.remember(operation("stored-small", arguments_json='{"amount":5}'))
    # Small arguments whose stored text is long: the stored text is what is measured.
    final.remember(operation("stored-long", arguments_json='{"amount":5,"note":"' + "x" * 300 + '"}'))
    final.remember(operation("not-stored"))  # made elsewhere: encoded once to measure it
    kept = [
        final.get("alice", "s1", s, now=50.0) is not None
        for s in ("stored-small", "stored-long", "not-stored")
    ]
    assert kept == [True, False, True]


@pytest.mark.anyio
async def test_a_claimed_operation_carries_its_arguments_as_stored(
    ledger: Ledger, record: SystemOfRecord
) -> None:
    boundary, _ = boundary_on(ledger, ScriptedTool(record), "key-required")
    answer = await charge(boundary, key="k-stored", amount=700)
    assert answer.operation is not None and answer.operation.arguments_json == '{"amount":700}'
    read = await ledger.get(answer.operation.principal, answer.operation.session, "k-stored")
    assert read is not None and read.arguments_json is not None
    assert json.loads(read.arguments_json) == read.arguments == {"amount": 700}
    assert record.count() == 1
