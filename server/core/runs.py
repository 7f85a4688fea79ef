"""The runs this process owns: attempts, retries and the record of each outcome.

Once the boundary has claimed or taken an operation, its work runs here, in a task of its own and
not of the request: a caller that gives up (client timeout, cancellation, `respond_within`) never
stops the work from recording its outcome. A run keeps the settings it was claimed under (its
`RunSettings`) until its outcome is recorded, so a policy reload never changes a call in flight.
The state of the runs lives here: the tasks in flight, the leases held, the final outcomes known.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from dataclasses import dataclass, field

import commitgate.server.core.tracing as tracing
from commitgate.server.core import errors
from commitgate.server.core.classes import Next, after_attempt, exhausted_state
from commitgate.server.core.errors import GateError
from commitgate.server.core.ground import Attempt, Site, attempt_of, exception_message, settle
from commitgate.server.core.replays import FinalOutcomes
from commitgate.server.core.requests import Answer, CallRequest, RunSettings, error_for_state
from commitgate.server.core.retry import Backoff, classify, error_record
from commitgate.server.ledger.base import Lease, LedgerUnavailable, Transition
from commitgate.server.model.audit import COMMITGATE, Actor, AuditEvent
from commitgate.server.model.context import OperationContext
from commitgate.server.model.events import Event
from commitgate.server.model.facts import State
from commitgate.server.model.notes import ReconciliationNote
from commitgate.server.model.outcomes import Outcome, RetryableError, Verdict
from commitgate.server.model.records import Operation, ToolResult

log = logging.getLogger("commitgate.boundary")

Held = tuple[int, float]  # the fence a run holds, and the lease (seconds) each renewal grants it

# respond_within runs out on this grid (seconds): an answer is due at most this much later.
DUE_GRID = 0.01


@dataclass(frozen=True, slots=True)
class _Run:
    """What stays the same across a run's attempts: the call it runs, the settings it keeps."""

    request: CallRequest
    settings: RunSettings


class DueAnswers:
    """The callers waiting for their work's answer, by the moment their respond_within runs out,
    rounded up to DUE_GRID: one timer per moment with callers, not one per call (a timer of its
    own cost every call a heap push and a cancel on the event loop)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._by_moment: dict[float, set[asyncio.Future[Answer | None]]] = {}

    def add(
        self, loop: asyncio.AbstractEventLoop, answered: asyncio.Future[Answer | None], within: float
    ) -> set[asyncio.Future[Answer | None]]:
        """Answer `answered` with None once `within` seconds have passed; the set it waits in."""
        if loop is not self._loop:  # the timers of another (closed) loop will never fire here
            self._loop, self._by_moment = loop, {}
        moment = math.ceil((loop.time() + within) / DUE_GRID) * DUE_GRID
        waiting = self._by_moment.get(moment)
        if waiting is None:
            waiting = self._by_moment[moment] = set()
            loop.call_at(moment, self._expire, moment)
        waiting.add(answered)
        return waiting

    def _expire(self, moment: float) -> None:
        for answered in self._by_moment.pop(moment, ()):
            settle(answered, None)


@dataclass
class Runs:
    site: Site
    _inflight: dict[str, asyncio.Task[Answer | None]] = field(default_factory=dict)
    leases: dict[str, Held] = field(default_factory=dict)  # operation_id -> what the renewal extends
    final: FinalOutcomes = field(default_factory=FinalOutcomes)  # replays answered without a ledger read
    _due: DueAnswers = field(default_factory=DueAnswers)

    def owns(self, operation_id: str) -> bool:
        """Whether this process is running the operation right now."""
        return operation_id in self._inflight

    def __contains__(self, operation_id: object) -> bool:  # `id in runs`, as a touch asks it
        return operation_id in self._inflight

    def task(self, operation_id: str) -> asyncio.Task[Answer | None] | None:
        return self._inflight.get(operation_id)

    async def drain(self, timeout: float = 10.0) -> None:
        pending = list(self._inflight.values())
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    async def own(
        self,
        request: CallRequest,
        op: Operation,
        settings: RunSettings,
        *,
        taken_at: float,
        maybe_applied: bool = False,
    ) -> Answer:
        """Run the work in a task of its own and wait for its answer, at most respond_within.

        Waiting never cancels the work: past respond_within, or if this caller goes away (its
        task cancelled), the work goes on and its outcome lands in the ledger for polling. The
        work hands its answer over itself, an event-loop turn sooner than a done callback would.
        """
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[Answer | None] = loop.create_future()  # None: not within respond_within
        run = _Run(request, settings)
        self._inflight[op.operation_id] = loop.create_task(
            self._work(run, op, maybe_applied, answered, taken_at), name=f"commitgate:{op.operation_id}"
        )
        waiting = self._due.add(loop, answered, settings.respond_within)
        try:
            answer = await answered
        finally:
            waiting.discard(answered)
        if answer is None:
            raise errors.in_progress(op)
        return answer

    async def _work(
        self,
        run: _Run,
        op: Operation,
        maybe_applied: bool,
        answered: asyncio.Future[Answer | None],
        taken_at: float,
    ) -> Answer | None:
        try:
            answer = await self._execute(run, op, maybe_applied, taken_at)
        except GateError as exc:  # the work's refusal is its answer, as in the boundary's `call`
            answer = Answer.refused(exc)
        except asyncio.CancelledError:
            answered.cancel()
            raise
        except BaseException as exc:
            if answered.done():  # nobody waits for it: asyncio reports it as a task's unretrieved error
                raise
            answered.set_exception(exc)  # raised in the caller, as a crash of the call
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise  # these stop the event loop too
            return None
        finally:
            self._inflight.pop(op.operation_id, None)
        settle(answered, answer)
        return answer

    async def _execute(self, run: _Run, op: Operation, maybe_applied: bool, taken_at: float) -> Answer:
        request, site = run.request, self.site
        tool, policy = request.tool, request.tool.policy
        deadline = site.monotonic() + policy.retry.deadline
        last_attempt = op.attempts + policy.retry.attempts - 1  # every call gets the full retry budget
        self.leases[op.operation_id] = (op.fence, run.settings.lease)
        actor = Actor.principal(request.principal)  # the call's own attempt; commitgate's after a retry
        try:
            while True:
                ctx = OperationContext(
                    request.key, request.session, op.operation_id, op.attempts, request.principal, tool.name
                )
                attempt = await tracing.attempted(
                    self._fenced_attempt(run, ctx, taken_at), tool.idempotency_class, ctx
                )
                next_move = after_attempt(tool.idempotency_class, attempt.outcome, policy.forwards_key)
                site.emit(
                    Event.ATTEMPT,
                    tool.name,
                    tool.idempotency_class,
                    outcome=attempt.outcome,
                    operation_id=op.operation_id,
                )
                maybe_applied |= attempt.outcome is Outcome.AMBIGUOUS and next_move is Next.RETRY
                if next_move is Next.RECONCILE:
                    verdict, found, note = await site.status_check(tool, op, op.attempts)
                    if verdict is Verdict.FOUND:
                        return await self._finish(
                            run,
                            op,
                            State.SUCCEEDED,
                            AuditEvent.RECONCILED_FOUND,
                            found,
                            None,
                            COMMITGATE,
                            note,
                        )
                    if verdict is Verdict.NOT_FOUND:  # certainly not applied: run again at once
                        next_move, attempt = (
                            Next.RETRY,
                            Attempt(Outcome.RETRYABLE, error=attempt.error, immediate=True),
                        )
                        maybe_applied = False  # the check covers every attempt under this key
                    elif policy.forwards_key:  # cannot tell, but the downstream dedups on the same key
                        next_move, maybe_applied = Next.RETRY, True
                    else:
                        return await self._finish(
                            run,
                            op,
                            State.UNKNOWN,
                            AuditEvent.AMBIGUOUS,
                            None,
                            attempt.error,
                            COMMITGATE,
                            note,
                        )
                if next_move is Next.RECORD_SUCCESS:
                    return await self._finish(
                        run, op, State.SUCCEEDED, AuditEvent.SUCCEEDED, attempt.result, None, actor
                    )
                if next_move is Next.RECORD_FAILED_FINAL:
                    return await self._finish(
                        run, op, State.FAILED_FINAL, AuditEvent.FAILED_FINAL, None, attempt.error, actor
                    )
                if next_move is Next.RECORD_UNKNOWN:
                    return await self._finish(
                        run, op, State.UNKNOWN, AuditEvent.AMBIGUOUS, None, attempt.error, actor
                    )
                retried = await self._next_attempt(run, op, attempt, deadline, last_attempt)
                if retried is None:
                    state = exhausted_state(attempt.outcome, maybe_applied=maybe_applied)
                    return await self._finish(
                        run, op, state, AuditEvent.RETRIES_EXHAUSTED, None, attempt.error, actor
                    )
                (op, taken_at), actor = retried, COMMITGATE
        finally:
            self.leases.pop(op.operation_id, None)

    async def _fenced_attempt(self, run: _Run, ctx: OperationContext, taken_at: float) -> Attempt:
        """An attempt starts only within the lease of its take (the owner fences itself): once the
        lease may have run out, another process may have taken the operation over, and counts on
        this attempt ending by the lease and the timeout. Nothing was sent: certainly not applied."""
        if self.site.monotonic() - taken_at >= run.settings.lease:
            lapsed = RetryableError("its lease ran out before the attempt started; nothing was sent")
            return Attempt(Outcome.RETRYABLE, error=lapsed)
        return await attempt_of(run.request.tool, run.request.arguments, ctx)

    async def _next_attempt(
        self, run: _Run, op: Operation, attempt: Attempt, deadline: float, last_attempt: int
    ) -> tuple[Operation, float] | None:
        """Sleep the backoff and take the next attempt in the ledger (with the moment of the take);
        None when out of attempts or time."""
        site = self.site
        if op.attempts >= last_attempt:
            return None
        backoff = Backoff(run.request.tool.policy.retry, site.rng)
        delay = 0.0 if attempt.immediate else backoff.delay(op.attempts, attempt.retry_after)
        if site.monotonic() + delay > deadline:
            return None
        await asyncio.sleep(delay)
        error = error_record(attempt.error, attempt.outcome) if attempt.error else None
        change = Transition(
            State.RUNNING,
            frozenset({State.RUNNING}),
            AuditEvent.RETRY,
            expect_fence=op.fence,
            lease=Lease(site.owner, site.clock() + run.settings.lease),
            error=error,
            actor=COMMITGATE,
        )
        taken_at = site.monotonic()
        retried = await site.ledger.update(op.operation_id, change, site.clock())
        if retried is None:
            raise errors.in_progress(await site.reread(op))  # fenced out: a newer attempt owns it
        self.leases[op.operation_id] = (retried.fence, run.settings.lease)
        site.emit(Event.RETRY, op.tool, op.idempotency_class, operation_id=op.operation_id)
        return retried, taken_at

    async def _finish(
        self,
        run: _Run,
        op: Operation,
        state: State,
        event: AuditEvent,
        result: ToolResult | None,
        error: BaseException | None,
        actor: Actor,
        reconciliation: ReconciliationNote | None = None,
    ) -> Answer:
        site = self.site
        error_json = error_record(error, classify(error)) if error is not None else None
        if result is not None:
            result = self._bounded(result, op, run.settings.max_result_bytes)
        change = Transition(
            state,
            frozenset({State.RUNNING}),
            event,
            expect_fence=op.fence,
            result=result,
            error=error_json,
            reconciliation=reconciliation,
            actor=actor,
        )
        recorded = await tracing.recorded(self._record(op, change), op, change.to_state)
        if recorded is None:
            recorded = await self._record_late(op, change)
        if recorded is not None:
            self.final.remember(recorded)
        site.emit(
            Event.COMPLETED,
            op.tool,
            op.idempotency_class,
            state=state,
            operation_id=op.operation_id,
            seconds=site.clock() - op.created_at,
        )
        forwards_key = run.request.tool.policy.forwards_key
        if recorded is None:  # fenced out: a newer attempt's outcome wins; answer from the ledger
            current = await site.reread(op)
            if current.state is State.SUCCEEDED:
                return Answer(current.result, current, True)
            raise error_for_state(current, forwards_key)
        if state is State.SUCCEEDED:
            return Answer(recorded.result, recorded, replayed=reconciliation is not None)
        raise error_for_state(recorded, forwards_key)

    def _bounded(self, result: ToolResult, op: Operation, limit: int) -> ToolResult:
        """A result over `limits.max_result_bytes` is not stored; the effect happened, so say so instead."""
        encoded = result.to_json()
        size = len(encoded) if encoded.isascii() else len(encoded.encode())
        if size <= limit:
            return result
        self.site.emit(Event.RESULT_TOO_LARGE, op.tool, op.idempotency_class, operation_id=op.operation_id)
        text = (
            f"The action succeeded, but its result was {size} bytes, over the limit of {limit}, so it was not "
            "stored or returned. Do not repeat the action; read the details you need with a read-only tool."
        )
        return ToolResult(
            [{"type": "text", "text": text}], {"result_too_large": {"bytes": size, "limit": limit}}
        )

    async def _record(self, op: Operation, change: Transition) -> Operation | None:
        """Record an outcome; a ledger hiccup is retried briefly, since the effect already happened."""
        for delay in (0.05, 0.2, 1.0, None):
            try:
                return await self.site.ledger.update(op.operation_id, change, self.site.clock(), current=op)
            except LedgerUnavailable:
                if delay is None:
                    log.error(
                        "could not record the outcome of %s; its lease will expire into UNKNOWN",
                        op.operation_id,
                    )
                    self.leases.pop(op.operation_id, None)
                    raise errors.outcome_unknown(op) from None
                await asyncio.sleep(delay)
        return None

    async def _record_late(self, op: Operation, change: Transition) -> Operation | None:
        """Record a certain outcome that arrived after our lease ran out (a stall, not a crash).

        The lease expiry turned the operation UNKNOWN (or a status check that ran before our
        effect was visible called it FAILED_RETRYABLE); if no newer attempt took it since (the
        fence is still ours), we are the best witness of how it ended, and saying so keeps it
        from staying UNKNOWN or from being run a second time. A newer attempt, or an operator's
        resolution, wins. An ambiguous outcome adds nothing and is not recorded.
        """
        if change.to_state not in (State.SUCCEEDED, State.FAILED_FINAL, State.FAILED_RETRYABLE):
            return None
        site = self.site
        late = dataclasses.replace(
            change,
            expect_states=frozenset({State.UNKNOWN, State.FAILED_RETRYABLE}),
            event=AuditEvent.LATE_OUTCOME,
            actor=COMMITGATE,
            reconciliation=ReconciliationNote("owner", site.clock(), change.to_state.value.lower()),
        )
        try:
            recorded = await site.ledger.update(op.operation_id, late, site.clock())
        except LedgerUnavailable:
            return None
        if recorded is not None:
            log.warning(
                "%s: recorded its outcome (%s) after its lease had expired",
                op.operation_id,
                recorded.state.value,
            )
        return recorded

    # --- safe-retry: attempts with no ledger ------------------------------------------------------

    async def unguarded(self, request: CallRequest) -> Answer:
        site, tool = self.site, request.tool
        retry = tool.policy.retry
        backoff = Backoff(retry, site.rng)
        deadline = site.monotonic() + retry.deadline
        attempt_number = 1
        while True:
            ctx = OperationContext(
                request.key, request.session, None, attempt_number, request.principal, tool.name
            )
            tried = await tracing.attempted(
                attempt_of(tool, request.arguments, ctx), tool.idempotency_class, ctx
            )
            if tried.outcome is Outcome.SUCCESS:
                return Answer(tried.result, None, False)
            message = exception_message(tried.error)
            if tried.outcome is Outcome.PERMANENT:
                raise errors.failed(message, None)
            delay = backoff.delay(attempt_number, tried.retry_after)
            if attempt_number >= retry.attempts or site.monotonic() + delay > deadline:
                raise errors.retries_exhausted(message, None)
            site.emit(Event.RETRY, tool.name, tool.idempotency_class)
            await asyncio.sleep(delay)
            attempt_number += 1
