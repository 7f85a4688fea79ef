"""The commit boundary: claim, execute, record, replay, reconcile.

Every keyed call is claimed in the ledger before its side effect runs and
recorded after it, each in one ledger write. The work of an owned operation
runs in a task owned by the boundary, not by the request: a caller that gives
up (client timeout, cancellation, `respond_within`) never stops the work from
recording its outcome. What a call is made of (and its fingerprint) is in
requests.py, the status check's verdicts in reconcile.py, the duties while
serving in duties.py: this module is the orchestration.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from enum import Enum
from typing import Any

import commitgate.server.core.tracing as tracing
from commitgate.server.core import approvals, budgets, duplicates, duties, errors, expiry, reconcile
from commitgate.server.core.classes import Next, OnExisting, after_attempt, exhausted_state, on_existing
from commitgate.server.core.errors import GateError
from commitgate.server.core.reconcile import Check
from commitgate.server.core.replays import FinalOutcomes
from commitgate.server.core.requests import (
    Answer,
    CallRequest,
    GuardedTool,
    canonical_json,
    error_for_state,
    fingerprint,
)
from commitgate.server.core.retry import Backoff, classify, error_record
from commitgate.server.core.views import status_view
from commitgate.server.ledger.base import (
    LEASE_LOST,
    BudgetCheck,
    Claim,
    ClaimKind,
    ClaimRequest,
    Lease,
    Ledger,
    LedgerUnavailable,
    OverBudget,
    Transition,
    lease_over,
    owner_known_dead,
    this_owner,
)
from commitgate.server.model.audit import COMMITGATE, Actor, AuditEvent
from commitgate.server.model.context import OperationContext
from commitgate.server.model.events import BoundaryEvent, Event, Observer
from commitgate.server.model.facts import ErrorCode, IdempotencyClass, State
from commitgate.server.model.notes import ErrorRecord, ReconciliationNote
from commitgate.server.model.outcomes import Outcome, RetryableError, ToolOutcomeError, Verdict
from commitgate.server.model.records import Operation, ToolResult
from commitgate.server.policy.models import ServerPolicy

log = logging.getLogger("commitgate.boundary")

# Beyond its lease and its timeout, the slack an attempt gets before another process may conclude
# it is over: the event loop's lag between the timeout and the cancellation taking effect.
ATTEMPT_SLACK = 1.0


@dataclass(slots=True)
class _Attempt:
    outcome: Outcome
    result: ToolResult | None = None
    error: BaseException | None = None
    immediate: bool = False  # the status check proved it did not happen: no reason to wait

    @property
    def retry_after(self) -> float | None:
        return self.error.retry_after if isinstance(self.error, ToolOutcomeError) else None


@dataclass
class CommitBoundary:
    ledger: Ledger
    settings: ServerPolicy
    tools: Mapping[str, GuardedTool] = field(default_factory=dict)
    observers: list[Observer] = field(default_factory=list)  # metrics, logs: each told every event
    clock: Callable[[], float] = time.time  # what the ledger records: times people read
    monotonic: Callable[[], float] = time.monotonic  # what this process alone decides: deadlines, waits
    rng: random.Random = field(default_factory=random.Random)
    owner: str = field(default_factory=this_owner)
    _inflight: dict[str, asyncio.Task[Answer | None]] = field(default_factory=dict)
    leases: dict[str, int] = field(default_factory=dict)  # operation_id -> fence we hold
    final: FinalOutcomes = field(default_factory=FinalOutcomes)  # replays answered without a ledger read

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

    # --- entry point ---------------------------------------------------------------

    async def call(self, request: CallRequest) -> Answer:
        """Every refusal or failure below is raised as a GateError where it is found; this is where a
        call's raised error becomes its answer (and `_work` does the same for a task's)."""
        try:
            if not request.tool.idempotency_class.keyed:
                return await self._unguarded(request)
            return await self._guarded(request)
        except GateError as exc:
            return Answer.refused(exc)

    async def _guarded(self, request: CallRequest) -> Answer:
        """Claim, then answer from what the claim found. A budgeted re-run of a failed operation
        claims once more (the claim is what checks the budget), so this loops at most twice."""
        while True:
            found = await self._claimed(request)
            if isinstance(found, Answer):
                return found
            answer = await self._on_existing(request, found, claimed=True)
            if answer is not _CLAIM_AGAIN:
                return answer

    async def _claimed(self, request: CallRequest) -> Answer | Operation:
        """Claim the call's key: an Answer when this call ran it, else the operation recorded before."""
        tool = request.tool
        arguments_json = request.arguments_json or canonical_json(request.arguments)
        step = request.key if request.key is not None else _missing_key(tool)
        digest = fingerprint(tool.name, arguments_json)
        now = self.clock()
        known = self.final.get(request.principal, request.session, step, now)
        if known is not None and known.tool == tool.name and known.fingerprint == digest:
            return known
        approval = approvals.requirement(
            tool.policy, request.arguments, request.principal, request.session, tool.name, now
        )
        budget = tool.budget
        amount = (
            budgets.amount_of(budget, request.arguments, request.principal, request.session, tool.name)
            if budget is not None
            else Decimal(0)
        )
        retention = tool.policy.retention or self.settings.retention
        claim_request = ClaimRequest(
            principal=request.principal,
            session=request.session,
            step=step,
            tool=tool.name,
            idempotency_class=tool.idempotency_class,
            fingerprint=digest,
            arguments_json=arguments_json,
            arguments=request.arguments,
            owner=self.owner,
            lease_seconds=self.settings.lease,
            # A budget adds up its window: every record in it must still be there.
            retention_seconds=max(retention, budget.policy.window) if budget is not None else retention,
            duplicates=duplicates.check_for(tool.policy, request.confirm_duplicate),
            approval=approval,
            budget=budgets.check_for(budget, amount, tool.policy, now) if budget is not None else None,
        )
        taken_at = self.monotonic()  # before the claim: the attempt's lease runs from no later than this
        claim = await self._claim(request, claim_request)
        if claim.kind is ClaimKind.CONFLICT:
            self.emit(
                Event.CONFLICT, tool.name, tool.idempotency_class, operation_id=claim.operation.operation_id
            )
            raise errors.key_reused(claim.operation, tool.name)
        if claim.kind is ClaimKind.DUPLICATE and duplicates.asks_approval(tool.policy):
            return await self._duplicate_to_approval(request, claim_request, claim.operation)
        if claim.kind is ClaimKind.DUPLICATE:
            raise await self._duplicate(request, claim.operation)
        if claim.kind is ClaimKind.AWAITING:
            raise self._awaiting_approval(request, claim.operation)
        if claim.duplicate_of is not None:
            self.emit(
                Event.DUPLICATE_ALLOWED, tool.name, tool.idempotency_class, operation_id=claim.duplicate_of
            )
        if claim.kind is ClaimKind.NEW:
            if tool.budget is not None and claim_request.budget is not None:
                self.emit(
                    Event.BUDGET_SPENT,
                    tool.name,
                    tool.idempotency_class,
                    operation_id=claim.operation.operation_id,
                    budget=tool.budget.name,
                    scope=budgets.scope_label(tool.budget, request.principal, request.session),
                    amount=claim_request.budget.amount,
                )
            return await self._own(request, claim.operation, taken_at=taken_at)
        self.final.remember(claim.operation)
        return claim.operation

    def _awaiting_approval(self, request: CallRequest, op: Operation) -> GateError:
        """`approval_pending` for an operation just recorded to wait (past its budget, perhaps)."""
        tool = request.tool
        self.emit(Event.APPROVAL_REQUESTED, tool.name, tool.idempotency_class, operation_id=op.operation_id)
        over = approvals.over_budget(op)
        if over is not None and tool.budget is not None:
            scope = budgets.scope_label(tool.budget, request.principal, request.session)
            self.emit(Event.BUDGET_EXCEEDED, tool.name, tool.idempotency_class, budget=over.name, scope=scope)
        return errors.approval_pending(op)

    def _over_budget(self, request: CallRequest, claim_request: ClaimRequest, spent: Decimal) -> GateError:
        tool, budget, check = request.tool, request.tool.budget, claim_request.budget
        assert budget is not None and check is not None
        scope = budgets.scope_label(budget, request.principal, request.session)
        self.emit(Event.BUDGET_EXCEEDED, tool.name, tool.idempotency_class, budget=budget.name, scope=scope)
        return budgets.exceeded(budget, check.amount, spent, request.principal, request.session)

    async def _claim(self, request: CallRequest, claim_request: ClaimRequest) -> Claim:
        tool = request.tool
        try:
            return await tracing.claimed(
                self.ledger.claim(claim_request, self.clock()), tool.idempotency_class
            )
        except LedgerUnavailable as exc:
            self.emit(Event.LEDGER_UNAVAILABLE, tool.name, tool.idempotency_class)
            raise _unavailable(exc) from None
        except OverBudget as over:
            raise self._over_budget(request, claim_request, over.spent) from None

    async def _duplicate_to_approval(
        self, request: CallRequest, claim_request: ClaimRequest, earlier: Operation
    ) -> Answer | Operation:
        """`duplicates = {action = "approval"}`: the repeat waits for a person, who sees the earlier one."""
        record = approvals.record(
            approvals.duplicate_settings(request.tool.policy), self.clock(), duplicate_of=earlier.operation_id
        )
        again = dataclasses.replace(claim_request, duplicates=None, approval=record)
        taken_at = self.monotonic()
        claim = await self._claim(request, again)
        if claim.kind is ClaimKind.CONFLICT:
            raise errors.key_reused(claim.operation, request.tool.name)
        if claim.kind is ClaimKind.AWAITING:
            self.emit(
                Event.POSSIBLE_DUPLICATE,
                request.tool.name,
                request.tool.idempotency_class,
                operation_id=earlier.operation_id,
            )
            raise errors.approval_pending(claim.operation)
        if claim.kind is ClaimKind.NEW:
            return await self._own(request, claim.operation, taken_at=taken_at)
        return claim.operation

    async def _duplicate(self, request: CallRequest, earlier: Operation) -> GateError:
        """`possible_duplicate`, showing the earlier operation as a poll would (reconciled if due)."""
        tool = request.tool
        self.emit(
            Event.POSSIBLE_DUPLICATE, tool.name, tool.idempotency_class, operation_id=earlier.operation_id
        )
        with contextlib.suppress(LedgerUnavailable, GateError):
            earlier = await self.poll(earlier)
        earlier_tool = self.tools.get(earlier.tool)
        forwards_key = bool(earlier_tool and earlier_tool.policy.forwards_key)
        view = status_view(earlier, forwards_key, self.clock())
        return duplicates.possible_duplicate(earlier, view, tool.name, self.clock())

    # --- an operation someone already recorded -----------------------------------------

    async def _on_existing(
        self, request: CallRequest, op: Operation, *, claimed: bool
    ) -> Answer | _ClaimAgain:
        """One loop over `on_existing` decisions. Each step answers, raises, or hands back the
        operation as it now stands (someone moved it first, a wait ended) to decide again."""
        waited = False
        while True:
            action = on_existing(op.idempotency_class, op.state, request.tool.policy.forwards_key)
            step = await self._decide(request, op, action, claimed=claimed, waited=waited)
            if not isinstance(step, Operation):
                return step
            # One wait per call: a second RUNNING answers in_progress (a person's wait keeps the mark).
            op, claimed = step, False
            waited = action is OnExisting.WAIT or (waited and action is OnExisting.AWAIT)

    async def _decide(
        self, request: CallRequest, op: Operation, action: OnExisting, *, claimed: bool, waited: bool
    ) -> Answer | Operation | _ClaimAgain:
        tool = request.tool
        if action is OnExisting.REPLAY:
            self.emit(Event.REPLAY, tool.name, tool.idempotency_class, operation_id=op.operation_id)
            return Answer(op.result, op, True)
        if action is OnExisting.FAIL:  # a recorded outcome, not this call's execution: replayed
            self.emit(Event.REPLAY, tool.name, tool.idempotency_class, operation_id=op.operation_id)
            raise _replayed(error_for_state(op))
        if action is OnExisting.AWAIT:
            return await self._awaiting(op)
        if action is OnExisting.TAKE:
            return await self._take(request, op)
        if action is OnExisting.WAIT:
            if waited:
                raise errors.in_progress(op)
            return await self._wait(op)
        if action is OnExisting.RECONCILE:
            return await self._reconcile_in_call(request, op)
        if action is OnExisting.RERUN:
            return await self._run_again(request, op, claimed=claimed)
        raise _replayed(errors.outcome_unknown(op))

    async def _run_again(
        self, request: CallRequest, op: Operation, *, claimed: bool
    ) -> Answer | Operation | _ClaimAgain:
        if op.state is State.FAILED_RETRYABLE and request.tool.budget is not None:
            # Running it again spends again: go through the claim, which checks the budget as it
            # takes the operation over (unless this very claim just saw it, and lost it to another).
            if not claimed:
                return _CLAIM_AGAIN
            raise _replayed(error_for_state(op))
        # From UNKNOWN (the downstream dedups on the key), an earlier attempt may have applied.
        return await self._rerun(request, op, maybe_applied=op.state is State.UNKNOWN)

    async def _awaiting(self, op: Operation) -> Operation:
        """A person has yet to decide: nothing runs. (Past its timeout, this touch expires it.)"""
        current = await self.touch_approval(op)
        if current.state is State.AWAITING_APPROVAL:
            raise errors.approval_pending(current)
        return current

    async def _take(self, request: CallRequest, op: Operation) -> Answer | Operation:
        """Run an approved operation: of all the calls that find it PENDING, one takes it. A budgeted
        one spends now: the ledger checks its budget with the take (docs/contract.md#budgets)."""
        tool, now, taken_at = request.tool, self.clock(), self.monotonic()
        lease = Lease(self.owner, now + self.settings.lease)
        check = None
        if tool.budget is not None:
            amount = budgets.amount_of(tool.budget, op.arguments, op.principal, op.session, tool.name)
            check = budgets.check_for(tool.budget, amount, tool.policy, now)
        try:
            taken = await self.ledger.update(
                op.operation_id, approvals.take_change(op, lease, check), now, current=op
            )
        except LedgerUnavailable as exc:
            raise _unavailable(exc) from None
        except OverBudget as over:
            assert check is not None
            return await self._refuse_take(request, op, check, over.spent)
        if taken is None:  # another call took it (or it moved on): answer from what it did
            return await self._reread(op)
        if check is not None and tool.budget is not None:
            self.emit(
                Event.BUDGET_SPENT,
                tool.name,
                tool.idempotency_class,
                operation_id=op.operation_id,
                budget=tool.budget.name,
                scope=budgets.scope_label(tool.budget, op.principal, op.session),
                amount=check.amount,
            )
        return await self._own(request, taken, taken_at=taken_at)

    async def _refuse_take(
        self, request: CallRequest, op: Operation, check: BudgetCheck, spent: Decimal
    ) -> Operation:
        """An approved operation whose budget has no room when it is taken: FAILED_FINAL with
        `budget_exceeded`, on this answer and every replay; nothing ran."""
        tool, budget = request.tool, request.tool.budget
        assert budget is not None
        scope = budgets.scope_label(budget, op.principal, op.session)
        self.emit(Event.BUDGET_EXCEEDED, tool.name, tool.idempotency_class, budget=budget.name, scope=scope)
        refused = budgets.exceeded(budget, check.amount, spent, op.principal, op.session, recorded=True)
        error = ErrorRecord(
            code=ErrorCode.BUDGET_EXCEEDED.value,
            message=refused.message,
            budget=refused.details.get("budget"),
        )
        change = Transition(
            State.FAILED_FINAL,
            frozenset({State.PENDING}),
            AuditEvent.BUDGET_EXCEEDED,
            expect_fence=op.fence,
            error=error,
            actor=Actor.principal(request.principal),
        )
        try:
            failed = await self.ledger.update(op.operation_id, change, self.clock())
        except LedgerUnavailable as exc:
            raise _unavailable(exc) from None
        if failed is None:  # taken or decided meanwhile: answer from what happened
            return await self._reread(op)
        raise errors.budget_exceeded_recorded(failed)

    async def _wait(self, op: Operation) -> Operation:
        """Wait (bounded by in_progress_wait) for another owner to finish; return the fresh record."""
        deadline = self.monotonic() + self.settings.in_progress_wait
        task = self._inflight.get(op.operation_id)
        if task is not None:  # the owner is this process: no polling needed
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(task), self.settings.in_progress_wait)
            return await self._reread(op)
        delay = 0.005
        while True:
            current = await self._reread(op)
            if current.state is not State.RUNNING:
                return current
            if lease_over(current, self.clock()):
                return await self.expire(current)
            if self.monotonic() + delay > deadline:
                return current
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def _reread(self, op: Operation) -> Operation:
        try:
            current = await self.ledger.get_by_id(op.principal, op.operation_id)
        except LedgerUnavailable as exc:
            raise _unavailable(exc) from None
        if current is None:  # purged meanwhile; nothing more is known
            return op
        return current

    async def touch_approval(self, op: Operation) -> Operation:
        return await expiry.expire_approval(self.ledger, op, self.clock(), self.tell)

    async def expire(self, op: Operation) -> Operation:
        return await expiry.expire_lease(self.ledger, op, self.clock(), self.tell)

    async def _rerun(
        self, request: CallRequest, op: Operation, *, maybe_applied: bool = False
    ) -> Answer | Operation:
        """Run again with the same key: the operation certainly did not apply, or the downstream dedups."""
        change = Transition(  # only from exactly what was seen: a newer attempt may have moved it since
            State.RUNNING,
            frozenset({op.state}) & {State.UNKNOWN, State.FAILED_RETRYABLE},
            AuditEvent.RERUN_CLAIMED,
            expect_fence=op.fence,
            lease=Lease(self.owner, self.clock() + self.settings.lease),
            actor=Actor.principal(request.principal),
        )
        taken_at = self.monotonic()
        taken = await self.ledger.update(op.operation_id, change, self.clock())
        if taken is None:  # someone else moved it first: answer from what they did
            return await self._reread(op)
        return await self._own(request, taken, maybe_applied=maybe_applied, taken_at=taken_at)

    async def _reconcile_in_call(self, request: CallRequest, op: Operation) -> Answer | Operation:
        verdict, found, note = await self._status_check(request.tool, op)
        if verdict is Verdict.FOUND:
            recorded = await self._record_reconciled(op, found, note)
            return Answer(recorded.result, recorded, True)
        if verdict is Verdict.NOT_FOUND and await self._may_still_run(op):
            await self._note_reconciliation(op, reconcile.too_soon(note))
            raise errors.in_progress(op)  # its attempt may still land: not found proves nothing yet
        if verdict is Verdict.NOT_FOUND:
            return await self._rerun(request, op)
        await self._note_reconciliation(op, note)
        if request.tool.policy.forwards_key:  # the downstream dedups on the key: the same key may go again
            return await self._rerun(request, await self._reread(op), maybe_applied=True)
        raise errors.outcome_unknown(op)

    # --- reconciliation -------------------------------------------------------------------

    async def _status_check(self, tool: GuardedTool, op: Operation, attempt: int | None = None) -> Check:
        return await tracing.reconciled(
            reconcile.status_check(tool, op, self.clock(), self.tell, attempt), op
        )

    async def _record_reconciled(
        self, op: Operation, found: ToolResult | None, note: ReconciliationNote
    ) -> Operation:
        change = reconcile.found(found, note)
        return await self.ledger.update(op.operation_id, change, self.clock()) or await self._reread(op)

    async def _note_reconciliation(self, op: Operation, note: ReconciliationNote) -> None:
        change = reconcile.undecided(note)
        with contextlib.suppress(LedgerUnavailable):
            await self.ledger.update(op.operation_id, change, self.clock())

    async def poll(self, op: Operation) -> Operation:
        """A poll is a touch: an expired lease turns UNKNOWN; a status-check tool then reconciles it;
        a wait for approval past its timeout expires."""
        op = await expiry.touch(self.ledger, op, self.clock(), self.tell, running=self._inflight)
        if op.idempotency_class is not IdempotencyClass.KEY_AND_STATUS_CHECK:
            return op
        tool = self.tools.get(op.tool)
        if op.state is not State.UNKNOWN or tool is None or not tool.source.has_status_check:
            return op
        verdict, found, note = await self._status_check(tool, op)
        if verdict is Verdict.FOUND:
            return await self._record_reconciled(op, found, note)
        if verdict is Verdict.NOT_FOUND and await self._may_still_run(op):
            note = reconcile.too_soon(note)  # its attempt may still land: it stays UNKNOWN
        elif verdict is Verdict.NOT_FOUND:
            change = reconcile.not_found(op, note)
            return await self.ledger.update(op.operation_id, change, self.clock()) or await self._reread(op)
        await self._note_reconciliation(op, note)
        return await self._reread(op)

    async def _may_still_run(self, op: Operation) -> bool:
        """Whether the operation's latest attempt may still be running, here or in another process.

        Only an attempt whose owner stopped recording (its lease lapsed) can be: an owner that
        recorded UNKNOWN itself did so once its attempt ended. Its owner started it within its lease
        of the take and runs it at most its timeout, so it is over once the take is older than both
        (on the ledger's clock: never this process's wall clock, which may have stepped), or when
        its owner is known to be gone.
        """
        if op.operation_id in self._inflight:
            return True
        if op.error is None or op.error.code != LEASE_LOST.code:
            return False
        try:
            start = await self.ledger.attempt_start(op.operation_id, op.fence)
        except LedgerUnavailable:
            return True  # cannot tell: not found proves nothing
        if start is None or start.owner == self.owner or owner_known_dead(start.owner):
            return False  # no start recorded (an older record), or ours and done, or its process is gone
        tool = self.tools.get(op.tool)
        timeout = tool.policy.timeout if tool is not None else self.settings.lease
        return start.age < self.settings.lease + timeout + ATTEMPT_SLACK

    # --- owning an operation: run, retry, record -------------------------------------------

    async def _own(
        self, request: CallRequest, op: Operation, *, taken_at: float, maybe_applied: bool = False
    ) -> Answer:
        """Run the work in a task of the boundary's and wait for its answer, at most respond_within.

        Waiting never cancels the work: past respond_within, or if this caller goes away (its
        task cancelled), the work goes on and its outcome lands in the ledger for polling. The
        work hands its answer over itself, an event-loop turn sooner than a done callback would.
        """
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[Answer | None] = loop.create_future()  # None: not within respond_within
        self._inflight[op.operation_id] = loop.create_task(
            self._work(request, op, maybe_applied, answered, taken_at), name=f"commitgate:{op.operation_id}"
        )
        timer = loop.call_later(self.settings.respond_within, _settle, answered, None)
        try:
            answer = await answered
        finally:
            timer.cancel()
        if answer is None:
            raise errors.in_progress(op)
        return answer

    async def _work(
        self,
        request: CallRequest,
        op: Operation,
        maybe_applied: bool,
        answered: asyncio.Future[Answer | None],
        taken_at: float,
    ) -> Answer | None:
        try:
            answer = await self._execute(request, op, maybe_applied, taken_at)
        except GateError as exc:  # the work's refusal is its answer, as in `call`
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
        _settle(answered, answer)
        return answer

    async def _execute(
        self, request: CallRequest, op: Operation, maybe_applied: bool, taken_at: float
    ) -> Answer:
        tool, policy = request.tool, request.tool.policy
        backoff = Backoff(policy.retry, self.rng)
        deadline = self.monotonic() + policy.retry.deadline
        last_attempt = op.attempts + policy.retry.attempts - 1  # every call gets the full retry budget
        self.leases[op.operation_id] = op.fence
        actor = Actor.principal(request.principal)  # the call's own attempt; commitgate's after a retry
        try:
            while True:
                ctx = OperationContext(
                    request.key, request.session, op.operation_id, op.attempts, request.principal, tool.name
                )
                attempt = await tracing.attempted(
                    self._fenced_attempt(tool, request.arguments, ctx, taken_at), tool.idempotency_class, ctx
                )
                next_move = after_attempt(tool.idempotency_class, attempt.outcome, policy.forwards_key)
                self.emit(
                    Event.ATTEMPT,
                    tool.name,
                    tool.idempotency_class,
                    outcome=attempt.outcome,
                    operation_id=op.operation_id,
                )
                maybe_applied |= attempt.outcome is Outcome.AMBIGUOUS and next_move is Next.RETRY
                if next_move is Next.RECONCILE:
                    verdict, found, note = await self._status_check(tool, op, op.attempts)
                    if verdict is Verdict.FOUND:
                        return await self._finish(
                            op, State.SUCCEEDED, AuditEvent.RECONCILED_FOUND, found, None, COMMITGATE, note
                        )
                    if verdict is Verdict.NOT_FOUND:  # certainly not applied: run again at once
                        next_move, attempt = (
                            Next.RETRY,
                            _Attempt(Outcome.RETRYABLE, error=attempt.error, immediate=True),
                        )
                        maybe_applied = False  # the check covers every attempt under this key
                    elif policy.forwards_key:  # cannot tell, but the downstream dedups on the same key
                        next_move, maybe_applied = Next.RETRY, True
                    else:
                        return await self._finish(
                            op, State.UNKNOWN, AuditEvent.AMBIGUOUS, None, attempt.error, COMMITGATE, note
                        )
                if next_move is Next.RECORD_SUCCESS:
                    return await self._finish(
                        op, State.SUCCEEDED, AuditEvent.SUCCEEDED, attempt.result, None, actor
                    )
                if next_move is Next.RECORD_FAILED_FINAL:
                    return await self._finish(
                        op, State.FAILED_FINAL, AuditEvent.FAILED_FINAL, None, attempt.error, actor
                    )
                if next_move is Next.RECORD_UNKNOWN:
                    return await self._finish(
                        op, State.UNKNOWN, AuditEvent.AMBIGUOUS, None, attempt.error, actor
                    )
                retried = await self._next_attempt(op, attempt, backoff, deadline, last_attempt)
                if retried is None:
                    state = exhausted_state(attempt.outcome, maybe_applied=maybe_applied)
                    return await self._finish(
                        op, state, AuditEvent.RETRIES_EXHAUSTED, None, attempt.error, actor
                    )
                (op, taken_at), actor = retried, COMMITGATE
        finally:
            self.leases.pop(op.operation_id, None)

    async def _fenced_attempt(
        self, tool: GuardedTool, arguments: dict[str, Any], ctx: OperationContext, taken_at: float
    ) -> _Attempt:
        """An attempt starts only within the lease of its take (the owner fences itself): once the
        lease may have run out, another process may have taken the operation over, and counts on
        this attempt ending by the lease and the timeout. Nothing was sent: certainly not applied."""
        if self.monotonic() - taken_at >= self.settings.lease:
            lapsed = RetryableError("its lease ran out before the attempt started; nothing was sent")
            return _Attempt(Outcome.RETRYABLE, error=lapsed)
        return await self._attempt(tool, arguments, ctx)

    async def _attempt(self, tool: GuardedTool, arguments: dict[str, Any], ctx: OperationContext) -> _Attempt:
        try:
            async with asyncio.timeout(tool.policy.timeout):
                return _Attempt(Outcome.SUCCESS, await tool.source.call(arguments, ctx))
        except Exception as exc:  # every failure is an outcome to classify, never a crash of the server
            return _Attempt(classify(exc), error=exc)

    async def _next_attempt(
        self, op: Operation, attempt: _Attempt, backoff: Backoff, deadline: float, last_attempt: int
    ) -> tuple[Operation, float] | None:
        """Sleep the backoff and take the next attempt in the ledger (with the moment of the take);
        None when out of attempts or time."""
        if op.attempts >= last_attempt:
            return None
        delay = 0.0 if attempt.immediate else backoff.delay(op.attempts, attempt.retry_after)
        if self.monotonic() + delay > deadline:
            return None
        await asyncio.sleep(delay)
        error = error_record(attempt.error, attempt.outcome) if attempt.error else None
        change = Transition(
            State.RUNNING,
            frozenset({State.RUNNING}),
            AuditEvent.RETRY,
            expect_fence=op.fence,
            lease=Lease(self.owner, self.clock() + self.settings.lease),
            error=error,
            actor=COMMITGATE,
        )
        taken_at = self.monotonic()
        retried = await self.ledger.update(op.operation_id, change, self.clock())
        if retried is None:
            raise errors.in_progress(await self._reread(op))  # fenced out: a newer attempt owns it
        self.leases[op.operation_id] = retried.fence
        self.emit(Event.RETRY, op.tool, op.idempotency_class, operation_id=op.operation_id)
        return retried, taken_at

    async def _finish(
        self,
        op: Operation,
        state: State,
        event: AuditEvent,
        result: ToolResult | None,
        error: BaseException | None,
        actor: Actor,
        reconciliation: ReconciliationNote | None = None,
    ) -> Answer:
        error_json = error_record(error, classify(error)) if error is not None else None
        if result is not None:
            result = self._bounded(result, op)
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
        self.emit(
            Event.COMPLETED,
            op.tool,
            op.idempotency_class,
            state=state,
            operation_id=op.operation_id,
            seconds=self.clock() - op.created_at,
        )
        if recorded is None:  # fenced out: a newer attempt's outcome wins; answer from the ledger
            current = await self._reread(op)
            if current.state is State.SUCCEEDED:
                return Answer(current.result, current, True)
            raise self._error_of(current)
        if state is State.SUCCEEDED:
            return Answer(recorded.result, recorded, replayed=reconciliation is not None)
        raise self._error_of(recorded)

    def _bounded(self, result: ToolResult, op: Operation) -> ToolResult:
        """A result over `limits.max_result_bytes` is not stored; the effect happened, so say so instead."""
        size = len(result.to_json().encode())
        limit = self.settings.limits.max_result_bytes
        if size <= limit:
            return result
        self.emit(Event.RESULT_TOO_LARGE, op.tool, op.idempotency_class, operation_id=op.operation_id)
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
                return await self.ledger.update(op.operation_id, change, self.clock(), current=op)
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
        late = dataclasses.replace(
            change,
            expect_states=frozenset({State.UNKNOWN, State.FAILED_RETRYABLE}),
            event=AuditEvent.LATE_OUTCOME,
            actor=COMMITGATE,
            reconciliation=ReconciliationNote("owner", self.clock(), change.to_state.value.lower()),
        )
        try:
            recorded = await self.ledger.update(op.operation_id, late, self.clock())
        except LedgerUnavailable:
            return None
        if recorded is not None:
            log.warning(
                "%s: recorded its outcome (%s) after its lease had expired",
                op.operation_id,
                recorded.state.value,
            )
        return recorded

    def _error_of(self, op: Operation) -> GateError:
        tool = self.tools.get(op.tool)
        return error_for_state(op, bool(tool and tool.policy.forwards_key))

    # --- safe-retry: no ledger -------------------------------------------------------------------

    async def _unguarded(self, request: CallRequest) -> Answer:
        tool = request.tool
        retry = tool.policy.retry
        backoff = Backoff(retry, self.rng)
        deadline = self.monotonic() + retry.deadline
        attempt_number = 1
        while True:
            ctx = OperationContext(
                request.key, request.session, None, attempt_number, request.principal, tool.name
            )
            attempt = await tracing.attempted(
                self._attempt(tool, request.arguments, ctx), tool.idempotency_class, ctx
            )
            if attempt.outcome is Outcome.SUCCESS:
                return Answer(attempt.result, None, False)
            message = _exception_message(attempt.error)
            if attempt.outcome is Outcome.PERMANENT:
                raise errors.failed(message, None)
            delay = backoff.delay(attempt_number, attempt.retry_after)
            if attempt_number >= retry.attempts or self.monotonic() + delay > deadline:
                raise errors.retries_exhausted(message, None)
            self.emit(Event.RETRY, tool.name, tool.idempotency_class)
            await asyncio.sleep(delay)
            attempt_number += 1

    # --- lifecycle: lease renewal, lease expiry, retention (duties.py) -------------------------------

    def running(
        self, *, sweep_every: float | None = None, purge_every: float = 60.0
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """Background duties while serving; on exit, in-flight work gets a moment to record its outcome."""
        return duties.running(self, sweep_every=sweep_every, purge_every=purge_every)

    async def drain(self, timeout: float = 10.0) -> None:
        pending = list(self._inflight.values())
        if pending:
            await asyncio.wait(pending, timeout=timeout)


class _ClaimAgain(Enum):
    """`_on_existing`'s answer when the call must go through the claim once more."""

    CLAIM_AGAIN = "claim again"


_CLAIM_AGAIN = _ClaimAgain.CLAIM_AGAIN


def _replayed(error: GateError) -> GateError:
    """A recorded failure answered again: not this call's execution."""
    error.replayed = True
    return error


def _settle(answered: asyncio.Future[Answer | None], answer: Answer | None) -> None:
    if not answered.done():
        answered.set_result(answer)


def _unavailable(exc: LedgerUnavailable) -> GateError:
    """The client is told only that nothing ran; the reason (a host, a path, a driver error) is logged."""
    log.warning("the ledger could not record a call, nothing was executed: %s", exc)
    return errors.ledger_unavailable()


def _missing_key(tool: GuardedTool) -> str:
    """The gateway checks keys first; a keyed call without one reaching here is still refused."""
    raise errors.key_required(tool.name)


def _exception_message(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    if isinstance(exc, ToolOutcomeError):
        return exc.message
    if isinstance(exc, TimeoutError):
        return "the tool did not answer within its timeout"
    return str(exc) or type(exc).__name__
