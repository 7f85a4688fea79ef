"""What the boundary's orchestration and the runs it owns share, below both.

The site they work on (the ledger, the clocks, who this process is, who listens), one attempt of a
tool and its outcome, and the small helpers both answer with. Nothing here knows of either.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from decimal import Decimal
from typing import Any

import commitgate.server.core.tracing as tracing
from commitgate.server.core import errors, reconcile
from commitgate.server.core.errors import GateError
from commitgate.server.core.reconcile import Check
from commitgate.server.core.requests import Answer, GuardedTool
from commitgate.server.core.retry import classify
from commitgate.server.ledger.base import Ledger, LedgerUnavailable, this_owner
from commitgate.server.model.context import OperationContext
from commitgate.server.model.events import BoundaryEvent, Event, Observer
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.outcomes import Outcome, ToolOutcomeError, Verdict
from commitgate.server.model.records import Operation, ToolResult

log = logging.getLogger("commitgate.boundary")


@dataclass
class Site:
    """Where calls are claimed and run: the ledger, the clocks, this process's name, the observers.
    Read when used, never copied, so a test may set the owner or the clock after construction."""

    ledger: Ledger
    _: KW_ONLY
    observers: list[Observer] = field(default_factory=list)  # metrics, logs: each told every event
    clock: Callable[[], float] = time.time  # what the ledger records: times people read
    monotonic: Callable[[], float] = time.monotonic  # what this process alone decides: deadlines, waits
    rng: random.Random = field(default_factory=random.Random)
    owner: str = field(default_factory=this_owner)

    def emit(
        self,
        kind: Event,
        tool: str,
        cls: IdempotencyClass,
        *,
        operation_id: str | None = None,
        outcome: Outcome | None = None,
        verdict: Verdict | None = None,
        state: State | None = None,
        seconds: float | None = None,
        budget: str | None = None,
        scope: str | None = None,
        amount: Decimal | None = None,
    ) -> None:
        """Tell every observer: one event, built only when someone listens."""
        if self.observers:
            self.tell(
                BoundaryEvent(
                    kind, tool, cls, operation_id, outcome, verdict, state, seconds, budget, scope, amount
                )
            )

    def tell(self, event: BoundaryEvent) -> None:
        """Every observer gets the same event (a status check tells its verdict inside its own span)."""
        for observer in self.observers:
            observer(event)

    async def reread(self, op: Operation) -> Operation:
        try:
            current = await self.ledger.get_by_id(op.principal, op.operation_id)
        except LedgerUnavailable as exc:
            raise unavailable(exc) from None
        if current is None:  # purged meanwhile; nothing more is known
            return op
        return current

    async def status_check(self, tool: GuardedTool, op: Operation, attempt: int | None = None) -> Check:
        return await tracing.reconciled(
            reconcile.status_check(tool, op, self.clock(), self.tell, attempt), op
        )


@dataclass(slots=True)
class Attempt:
    outcome: Outcome
    result: ToolResult | None = None
    error: BaseException | None = None
    immediate: bool = False  # the status check proved it did not happen: no reason to wait

    @property
    def retry_after(self) -> float | None:
        return self.error.retry_after if isinstance(self.error, ToolOutcomeError) else None


async def attempt_of(tool: GuardedTool, arguments: dict[str, Any], ctx: OperationContext) -> Attempt:
    """One call of the tool's source under its timeout: every failure is an outcome to classify."""
    try:
        async with asyncio.timeout(tool.policy.timeout):
            return Attempt(Outcome.SUCCESS, await tool.source.call(arguments, ctx))
    except Exception as exc:  # never a crash of the server
        return Attempt(classify(exc), error=exc)


def settle(answered: asyncio.Future[Answer | None], answer: Answer | None) -> None:
    if not answered.done():
        answered.set_result(answer)


def unavailable(exc: LedgerUnavailable) -> GateError:
    """The client is told only that nothing ran; the reason (a host, a path, a driver error) is logged."""
    log.warning("the ledger could not record a call, nothing was executed: %s", exc)
    return errors.ledger_unavailable()


def replayed(error: GateError) -> GateError:
    """A recorded failure answered again: not this call's execution."""
    error.replayed = True
    return error


def exception_message(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    if isinstance(exc, ToolOutcomeError):
        return exc.message
    if isinstance(exc, TimeoutError):
        return "the tool did not answer within its timeout"
    return str(exc) or type(exc).__name__
