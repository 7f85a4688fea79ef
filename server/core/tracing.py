"""OpenTelemetry spans for the commit boundary, under the MCP SDK's `tools/call` span.

`commitgate.claim`, one `commitgate.attempt` per attempt (with its outcome),
`commitgate.reconcile` (a status check) and `commitgate.record` (the outcome
written to the ledger), with the attributes `commitgate.operation_id`,
`commitgate.class`, `commitgate.state`, `commitgate.attempt`; the boundary's
events (replays, conflicts, lease expiries, retries, ...) become span events.

What never goes into a span: argument values, results, error messages (they
may quote arguments), keys, sessions, principals and tokens. Failures carry
only their outcome and the exception's type.

Every wrapper here checks the trace switch first: with tracing off a call costs
one attribute read per step (see `commitgate bench --only tracing`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from commitgate.server.ledger.base import OverBudget
from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.model.traces import SWITCH

P = ParamSpec("P")
T = TypeVar("T")

OPERATION_ID = "commitgate.operation_id"
CLASS = "commitgate.class"
STATE = "commitgate.state"
REPLAYED = "commitgate.replayed"
ATTEMPT = "commitgate.attempt"
OUTCOME = "commitgate.outcome"
VERDICT = "commitgate.verdict"
CLAIM = "commitgate.claim"

# Only these fields of a boundary event become span-event attributes: identifiers and fixed sets
# of words, never anything a client sent (arguments, keys, sessions) or a message that may quote it.
_SAFE_FIELDS = frozenset(
    {"operation_id", "state", "verdict", "outcome", "code", "duplicate_of", "budget", "via", "decision"}
)
_SPAN_EVENTS_SKIPPED = frozenset({"attempt", "completed"})  # already spans of their own


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


async def claimed(step: Awaitable[T], tool: Any) -> T:
    """`commitgate.claim` around a ledger claim of `tool`'s call: which operation, in which state, and
    how it was found (new, existing, conflict...)."""
    if SWITCH.tracer is None:
        return await step
    with _span("commitgate.claim", {CLASS: tool.idempotency_class.value}) as span:
        try:
            claim = await step
        except OverBudget:  # an answer, not a failure: nothing was claimed
            span.set_attribute(CLAIM, "over_budget")
            raise
        except Exception as exc:
            _failed(span, "ledger_unavailable", exc)
            raise
        op = getattr(claim, "operation", None)
        if op is not None:
            span.set_attribute(OPERATION_ID, op.operation_id)
            span.set_attribute(STATE, op.state.value)
        kind = getattr(claim, "kind", None)
        if kind is not None:
            span.set_attribute(CLAIM, str(getattr(kind, "value", kind)))
        return claim


def attempt(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """`commitgate.attempt` around one execution of a tool, `(self, tool, arguments, ctx) -> _Attempt`."""

    @functools.wraps(fn)
    async def traced(*args: P.args, **kwargs: P.kwargs) -> T:
        if SWITCH.tracer is None:
            return await fn(*args, **kwargs)
        tool, ctx = args[1], args[3]
        attributes: dict[str, Any] = {CLASS: tool.idempotency_class.value, ATTEMPT: ctx.attempt}  # type: ignore[attr-defined]
        if ctx.operation_id is not None:  # type: ignore[attr-defined]
            attributes[OPERATION_ID] = ctx.operation_id  # type: ignore[attr-defined]
        with _span("commitgate.attempt", attributes) as span:
            result = await fn(*args, **kwargs)
            outcome = result.outcome.value  # type: ignore[attr-defined]
            span.set_attribute(OUTCOME, outcome)
            if outcome != "success":
                _failed(span, outcome, result.error)  # type: ignore[attr-defined]
            return result

    return traced


def reconcile(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """`commitgate.reconcile` around a status check, `(self, tool, op, ...) -> (verdict, found, note)`."""

    @functools.wraps(fn)
    async def traced(*args: P.args, **kwargs: P.kwargs) -> T:
        if SWITCH.tracer is None:
            return await fn(*args, **kwargs)
        op = args[2]
        with _span("commitgate.reconcile", _of(op)) as span:
            answer = await fn(*args, **kwargs)
            span.set_attribute(VERDICT, answer[0].value)  # type: ignore[index]
            return answer

    return traced


def record(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """`commitgate.record` around writing an outcome, `(self, op, change) -> Operation | None`."""

    @functools.wraps(fn)
    async def traced(*args: P.args, **kwargs: P.kwargs) -> T:
        if SWITCH.tracer is None:
            return await fn(*args, **kwargs)
        op, change = args[1], args[2]
        attributes = {**_of(op), STATE: change.to_state.value}  # type: ignore[attr-defined]
        with _span("commitgate.record", attributes) as span:
            try:
                recorded = await fn(*args, **kwargs)
            except Exception as exc:
                _failed(span, "not_recorded", exc)
                raise
            if recorded is None:  # a newer attempt or an operator moved it first
                span.add_event("commitgate.fenced_out")
            return recorded

    return traced


def _of(op: Any) -> dict[str, Any]:
    return {
        OPERATION_ID: op.operation_id,
        CLASS: op.idempotency_class.value,
        STATE: op.state.value,
        ATTEMPT: op.attempts,
    }


class SpanEvents:
    """An observer that adds each boundary event to the current span (a short span of its own when
    none is current, e.g. a lease expiry found by the background sweep)."""

    def __call__(self, event: str, tool: str, cls: IdempotencyClass, **fields: Any) -> None:
        tracer = SWITCH.tracer
        if tracer is None or event in _SPAN_EVENTS_SKIPPED:
            return
        try:
            from opentelemetry import trace

            attributes: dict[str, Any] = {"gen_ai.tool.name": tool, CLASS: cls.value}
            for name, value in fields.items():
                if name in _SAFE_FIELDS and isinstance(value, str | int | float | bool):
                    attributes[f"commitgate.{name}"] = value
            span = trace.get_current_span()
            if span.is_recording():
                span.add_event(f"commitgate.{event}", attributes)
            else:
                with tracer.start_as_current_span(f"commitgate.{event}") as own:
                    own.add_event(f"commitgate.{event}", attributes)
        except Exception:  # instrumentation must never break a call
            return


def span_events() -> list[SpanEvents]:
    """The observers to add while tracing is on: none (no cost at all) when it is off."""
    return [] if SWITCH.tracer is None else [SpanEvents()]
