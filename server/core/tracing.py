"""OpenTelemetry spans for the commit boundary, under the MCP SDK's `tools/call` span.

`commitgate.claim`, one `commitgate.attempt` per attempt (with its outcome),
`commitgate.reconcile` (a status check) and `commitgate.record` (the outcome
written to the ledger), with the attributes `commitgate.operation_id`,
`commitgate.class`, `commitgate.state`, `commitgate.attempt`; the boundary's
events (replays, conflicts, lease expiries, retries, ...) become span events.

What never goes into a span: argument values, results, error messages (they
may quote arguments), keys, sessions, principals and tokens. Failures carry
only their outcome and the exception's type.

The boundary hands each step's awaitable to the function of its span here; with
tracing off that function gives the awaitable back untouched, so a call costs one
function call and one attribute read per step (see `commitgate bench --only tracing`).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from commitgate.server.ledger.base import Claim, OverBudget
from commitgate.server.model.context import OperationContext
from commitgate.server.model.events import BoundaryEvent, Event
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.outcomes import Outcome, Verdict
from commitgate.server.model.records import Operation
from commitgate.server.model.traces import SWITCH

OPERATION_ID = "commitgate.operation_id"
CLASS = "commitgate.class"
STATE = "commitgate.state"
REPLAYED = "commitgate.replayed"
ATTEMPT = "commitgate.attempt"
OUTCOME = "commitgate.outcome"
VERDICT = "commitgate.verdict"
CLAIM = "commitgate.claim"
BUDGET = "commitgate.budget"

# What a span event says beyond the tool and class: identifiers and words of fixed sets, never a
# budget's scope (it may name a principal or a session) or an amount (it comes from the arguments).
_SPAN_EVENTS_SKIPPED = frozenset({Event.ATTEMPT, Event.COMPLETED})  # already spans of their own


def _span(name: str, attributes: dict[str, Any]) -> Any:
    # Exceptions are not recorded as such: their messages may quote argument values.
    return SWITCH.tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    )


def _failed(span: Any, reason: str, exc: BaseException | None = None) -> None:
    from opentelemetry.trace import Status, StatusCode

    if exc is not None:
        span.set_attribute("error.type", type(exc).__name__)
    span.set_status(Status(StatusCode.ERROR, reason))


def claimed(step: Awaitable[Claim], cls: IdempotencyClass) -> Awaitable[Claim]:
    """`step` (a ledger claim) inside `commitgate.claim` when tracing is on: which operation, in
    which state, and how it was found (new, existing, conflict...). Off, `step` itself."""
    return step if SWITCH.tracer is None else _claimed(step, cls)


async def _claimed(step: Awaitable[Claim], cls: IdempotencyClass) -> Claim:
    with _span("commitgate.claim", {CLASS: cls.value}) as span:
        try:
            claim = await step
        except OverBudget:  # an answer, not a failure: nothing was claimed
            span.set_attribute(CLAIM, "over_budget")
            raise
        except Exception as exc:
            _failed(span, "ledger_unavailable", exc)
            raise
        span.set_attribute(OPERATION_ID, claim.operation.operation_id)
        span.set_attribute(STATE, claim.operation.state.value)
        span.set_attribute(CLAIM, claim.kind.value)
        return claim


class Attempted(Protocol):
    @property
    def outcome(self) -> Outcome: ...
    @property
    def error(self) -> BaseException | None: ...


A = TypeVar("A", bound=Attempted)


def attempted(step: Awaitable[A], cls: IdempotencyClass, ctx: OperationContext) -> Awaitable[A]:
    """`step` (one execution of a tool) inside `commitgate.attempt` when tracing is on, with its
    outcome. Off, `step` itself."""
    return step if SWITCH.tracer is None else _attempted(step, cls, ctx)


async def _attempted(step: Awaitable[A], cls: IdempotencyClass, ctx: OperationContext) -> A:
    attributes: dict[str, Any] = {CLASS: cls.value, ATTEMPT: ctx.attempt}
    if ctx.operation_id is not None:
        attributes[OPERATION_ID] = ctx.operation_id
    with _span("commitgate.attempt", attributes) as span:
        result = await step
        outcome = result.outcome.value
        span.set_attribute(OUTCOME, outcome)
        if outcome != "success":
            _failed(span, outcome, result.error)
        return result


V = TypeVar("V", bound=tuple[Verdict, Any, Any])


def reconciled(step: Awaitable[V], op: Operation) -> Awaitable[V]:
    """`step` (a status check of `op`) inside `commitgate.reconcile` when tracing is on, with its
    verdict. Off, `step` itself."""
    return step if SWITCH.tracer is None else _reconciled(step, op)


async def _reconciled(step: Awaitable[V], op: Operation) -> V:
    with _span("commitgate.reconcile", _of(op)) as span:
        answer = await step
        span.set_attribute(VERDICT, answer[0].value)
        return answer


def recorded(step: Awaitable[Operation | None], op: Operation, to: State) -> Awaitable[Operation | None]:
    """`step` (writing `op`'s outcome, state `to`) inside `commitgate.record` when tracing is on.
    Off, `step` itself."""
    return step if SWITCH.tracer is None else _recorded(step, op, to)


async def _recorded(step: Awaitable[Operation | None], op: Operation, to: State) -> Operation | None:
    with _span("commitgate.record", {**_of(op), STATE: to.value}) as span:
        try:
            recorded = await step
        except Exception as exc:
            _failed(span, "not_recorded", exc)
            raise
        if recorded is None:  # a newer attempt or an operator moved it first
            span.add_event("commitgate.fenced_out")
        return recorded


def _of(op: Operation) -> dict[str, Any]:
    return {
        OPERATION_ID: op.operation_id,
        CLASS: op.idempotency_class.value,
        STATE: op.state.value,
        ATTEMPT: op.attempts,
    }


class SpanEvents:
    """An observer that adds each boundary event to the current span (a short span of its own when
    none is current, e.g. a lease expiry found by the background sweep)."""

    def __call__(self, event: BoundaryEvent) -> None:
        tracer = SWITCH.tracer
        if tracer is None or event.kind in _SPAN_EVENTS_SKIPPED:
            return
        try:
            from opentelemetry import trace

            name = f"commitgate.{event.kind.value}"
            span = trace.get_current_span()
            if span.is_recording():
                span.add_event(name, _span_event(event))
            else:
                with tracer.start_as_current_span(name) as own:
                    own.add_event(name, _span_event(event))
        except Exception:  # instrumentation must never break a call
            return


def _span_event(event: BoundaryEvent) -> dict[str, str]:
    attributes = {"gen_ai.tool.name": event.tool, CLASS: event.cls.value}
    for attribute, value in (
        (OPERATION_ID, event.operation_id),
        (STATE, event.state),
        (VERDICT, event.verdict),
        (OUTCOME, event.outcome),
        (BUDGET, event.budget),
    ):
        if value is not None:
            attributes[attribute] = str(value)
    return attributes


def span_events() -> list[SpanEvents]:
    """The observers to add while tracing is on: none (no cost at all) when it is off."""
    return [] if SWITCH.tracer is None else [SpanEvents()]
