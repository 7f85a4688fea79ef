"""The commit boundary: claim, replay, decide what a recorded operation calls for, reconcile.

Every keyed call is claimed in the ledger before its side effect runs and recorded after it, each
in one ledger write. This module is the orchestration: what a claim found and what follows from
it (the decision tables of classes.py), duplicates, approvals and budgets. The work of an operation
this process owns runs in runs.py, under the settings of the policy its call was claimed under;
what a call is made of (and its fingerprint) is in requests.py, the status check's verdicts in
reconcile.py, the duties while serving in duties.py, what all of them share in ground.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from enum import Enum

import commitgate.server.core.tracing as tracing
from commitgate.server.core import approvals, budgets, duplicates, duties, errors, expiry, reconcile
from commitgate.server.core.classes import OnExisting, on_existing
from commitgate.server.core.errors import GateError
from commitgate.server.core.ground import Site, replayed, unavailable
from commitgate.server.core.requests import (
    Answer,
    CallRequest,
    GuardedTool,
    RunSettings,
    error_for_state,
    fingerprint,
)
from commitgate.server.core.runs import Runs
from commitgate.server.core.views import status_view
from commitgate.server.ledger.base import (
    LEASE_LOST,
    BudgetCheck,
    Claim,
    ClaimKind,
    ClaimRequest,
    Lease,
    LedgerUnavailable,
    OverBudget,
    Transition,
    lease_over,
    owner_known_dead,
)
from commitgate.server.model.audit import Actor, AuditEvent
from commitgate.server.model.canonical import canonical_json
from commitgate.server.model.events import Event
from commitgate.server.model.facts import ErrorCode, IdempotencyClass, State
from commitgate.server.model.notes import ErrorRecord, ReconciliationNote
from commitgate.server.model.outcomes import Verdict
from commitgate.server.model.records import Operation, ToolResult
from commitgate.server.policy.models import ServerPolicy

# Beyond its lease and its timeout, the slack an attempt gets before another process may conclude
# it is over: the event loop's lag between the timeout and the cancellation taking effect.
ATTEMPT_SLACK = 1.0


@dataclass
class CommitBoundary(Site):
    # The current policy's settings and tools, for what no call brings its own of: polls, the
    # duties' pace, and requests built without a policy generation (tests, benchmarks). A call
    # from the gateway carries its generation's settings and tool, which a reload never changes.
    settings: ServerPolicy
    tools: Mapping[str, GuardedTool] = field(default_factory=dict)
    runs: Runs = field(init=False)  # the operations this process owns, run to their recorded outcome

    def __post_init__(self) -> None:
        self.runs = Runs(self)

    # --- entry point ---------------------------------------------------------------

    async def call(self, request: CallRequest) -> Answer:
        """Claim, then answer from what the claim found. A budgeted re-run of a failed operation
        claims once more (the claim is what checks the budget), so this loops at most twice.

        Every refusal or failure below is raised as a GateError where it is found; this is where a
        call's raised error becomes its answer (and the runs do the same for a task's). One frame
        for both: every resumption of a waiting call passes through each frame of its chain."""
        try:
            if not request.tool.keyed:
                return await self.runs.unguarded(request)
            settings = request.settings or RunSettings.of(self.settings)  # the call's, to its outcome
            while True:
                found = await self._claimed(request, settings)
                if isinstance(found, Answer):
                    return found
                answer = await self._on_existing(request, settings, found, claimed=True)
                if answer is not _CLAIM_AGAIN:
                    return answer
        except GateError as exc:
            return Answer.refused(exc)

    async def _claimed(self, request: CallRequest, settings: RunSettings) -> Answer | Operation:
        """Claim the call's key: an Answer when this call ran it, else the operation recorded before."""
        tool = request.tool
        arguments_json = request.arguments_json or canonical_json(request.arguments)
        step = request.key if request.key is not None else _missing_key(tool)
        digest = fingerprint(tool.name, arguments_json)
        now = self.clock()
        known = self.runs.final.get(request.principal, request.session, step, now)
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
        retention = tool.policy.retention or settings.retention
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
            lease_seconds=settings.lease,
            # A budget adds up its window: every record in it must still be there.
            retention_seconds=max(retention, budget.policy.window) if budget is not None else retention,
            duplicates=tool.duplicate_checks[request.confirm_duplicate],
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
            return await self._duplicate_to_approval(request, settings, claim_request, claim.operation)
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
            return await self.runs.own(request, claim.operation, settings, taken_at=taken_at)
        self.runs.final.remember(claim.operation)
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
            raise unavailable(exc) from None
        except OverBudget as over:
            raise self._over_budget(request, claim_request, over.spent) from None

    async def _duplicate_to_approval(
        self, request: CallRequest, settings: RunSettings, claim_request: ClaimRequest, earlier: Operation
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
            return await self.runs.own(request, claim.operation, settings, taken_at=taken_at)
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
        self, request: CallRequest, settings: RunSettings, op: Operation, *, claimed: bool
    ) -> Answer | _ClaimAgain:
        """One loop over `on_existing` decisions. Each step answers, raises, or hands back the
        operation as it now stands (someone moved it first, a wait ended) to decide again."""
        waited = False
        while True:
            action = on_existing(op.idempotency_class, op.state, request.tool.policy.forwards_key)
            step = await self._decide(request, settings, op, action, claimed=claimed, waited=waited)
            if not isinstance(step, Operation):
                return step
            # One wait per call: a second RUNNING answers in_progress (a person's wait keeps the mark).
            op, claimed = step, False
            waited = action is OnExisting.WAIT or (waited and action is OnExisting.AWAIT)

    async def _decide(
        self,
        request: CallRequest,
        settings: RunSettings,
        op: Operation,
        action: OnExisting,
        *,
        claimed: bool,
        waited: bool,
    ) -> Answer | Operation | _ClaimAgain:
        tool = request.tool
        if action is OnExisting.REPLAY:
            self.emit(Event.REPLAY, tool.name, tool.idempotency_class, operation_id=op.operation_id)
            return Answer(op.result, op, True)
        if action is OnExisting.FAIL:  # a recorded outcome, not this call's execution: replayed
            self.emit(Event.REPLAY, tool.name, tool.idempotency_class, operation_id=op.operation_id)
            raise replayed(error_for_state(op))
        if action is OnExisting.AWAIT:
            return await self._awaiting(op)
        if action is OnExisting.TAKE:
            return await self._take(request, settings, op)
        if action is OnExisting.WAIT:
            if waited:
                raise errors.in_progress(op)
            return await self._wait(op, settings.in_progress_wait)
        if action is OnExisting.RECONCILE:
            return await self._reconcile_in_call(request, settings, op)
        if action is OnExisting.RERUN:
            return await self._run_again(request, settings, op, claimed=claimed)
        raise replayed(errors.outcome_unknown(op))

    async def _run_again(
        self, request: CallRequest, settings: RunSettings, op: Operation, *, claimed: bool
    ) -> Answer | Operation | _ClaimAgain:
        if op.state is State.FAILED_RETRYABLE and request.tool.budget is not None:
            # Running it again spends again: go through the claim, which checks the budget as it
            # takes the operation over (unless this very claim just saw it, and lost it to another).
            if not claimed:
                return _CLAIM_AGAIN
            raise replayed(error_for_state(op))
        # From UNKNOWN (the downstream dedups on the key), an earlier attempt may have applied.
        return await self._rerun(request, settings, op, maybe_applied=op.state is State.UNKNOWN)

    async def _awaiting(self, op: Operation) -> Operation:
        """A person has yet to decide: nothing runs. (Past its timeout, this touch expires it.)"""
        current = await self.touch_approval(op)
        if current.state is State.AWAITING_APPROVAL:
            raise errors.approval_pending(current)
        return current

    async def _take(self, request: CallRequest, settings: RunSettings, op: Operation) -> Answer | Operation:
        """Run an approved operation: of all the calls that find it PENDING, one takes it. A budgeted
        one spends now: the ledger checks its budget with the take (docs/contract.md#budgets)."""
        tool, now, taken_at = request.tool, self.clock(), self.monotonic()
        lease = Lease(self.owner, now + settings.lease)
        check = None
        if tool.budget is not None:
            amount = budgets.amount_of(tool.budget, op.arguments, op.principal, op.session, tool.name)
            check = budgets.check_for(tool.budget, amount, tool.policy, now)
        try:
            taken = await self.ledger.update(
                op.operation_id, approvals.take_change(op, lease, check), now, current=op
            )
        except LedgerUnavailable as exc:
            raise unavailable(exc) from None
        except OverBudget as over:
            assert check is not None
            return await self._refuse_take(request, op, check, over.spent)
        if taken is None:  # another call took it (or it moved on): answer from what it did
            return await self.reread(op)
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
        return await self.runs.own(request, taken, settings, taken_at=taken_at)

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
            raise unavailable(exc) from None
        if failed is None:  # taken or decided meanwhile: answer from what happened
            return await self.reread(op)
        raise errors.budget_exceeded_recorded(failed)

    async def _wait(self, op: Operation, wait: float) -> Operation:
        """Wait (bounded by in_progress_wait) for another owner to finish; return the fresh record."""
        deadline = self.monotonic() + wait
        task = self.runs.task(op.operation_id)
        if task is not None:  # the owner is this process: no polling needed
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(task), wait)
            return await self.reread(op)
        delay = 0.005
        while True:
            current = await self.reread(op)
            if current.state is not State.RUNNING:
                return current
            if lease_over(current, self.clock()):
                return await self.expire(current)
            if self.monotonic() + delay > deadline:
                return current
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def touch_approval(self, op: Operation) -> Operation:
        return await expiry.expire_approval(self.ledger, op, self.clock(), self.tell)

    async def expire(self, op: Operation) -> Operation:
        return await expiry.expire_lease(self.ledger, op, self.clock(), self.tell)

    async def _rerun(
        self, request: CallRequest, settings: RunSettings, op: Operation, *, maybe_applied: bool = False
    ) -> Answer | Operation:
        """Run again with the same key: the operation certainly did not apply, or the downstream dedups."""
        change = Transition(  # only from exactly what was seen: a newer attempt may have moved it since
            State.RUNNING,
            frozenset({op.state}) & {State.UNKNOWN, State.FAILED_RETRYABLE},
            AuditEvent.RERUN_CLAIMED,
            expect_fence=op.fence,
            lease=Lease(self.owner, self.clock() + settings.lease),
            actor=Actor.principal(request.principal),
        )
        taken_at = self.monotonic()
        taken = await self.ledger.update(op.operation_id, change, self.clock())
        if taken is None:  # someone else moved it first: answer from what they did
            return await self.reread(op)
        return await self.runs.own(request, taken, settings, maybe_applied=maybe_applied, taken_at=taken_at)

    async def _reconcile_in_call(
        self, request: CallRequest, settings: RunSettings, op: Operation
    ) -> Answer | Operation:
        verdict, found, note = await self.status_check(request.tool, op)
        if verdict is Verdict.FOUND:
            recorded = await self._record_reconciled(op, found, note)
            return Answer(recorded.result, recorded, True)
        if verdict is Verdict.NOT_FOUND and await self._may_still_run(op, settings.lease):
            await self._note_reconciliation(op, reconcile.too_soon(note))
            raise errors.in_progress(op)  # its attempt may still land: not found proves nothing yet
        if verdict is Verdict.NOT_FOUND:
            return await self._rerun(request, settings, op)
        await self._note_reconciliation(op, note)
        if request.tool.policy.forwards_key:  # the downstream dedups on the key: the same key may go again
            return await self._rerun(request, settings, await self.reread(op), maybe_applied=True)
        raise errors.outcome_unknown(op)

    # --- reconciliation -------------------------------------------------------------------

    async def _record_reconciled(
        self, op: Operation, found: ToolResult | None, note: ReconciliationNote
    ) -> Operation:
        change = reconcile.found(found, note)
        return await self.ledger.update(op.operation_id, change, self.clock()) or await self.reread(op)

    async def _note_reconciliation(self, op: Operation, note: ReconciliationNote) -> None:
        change = reconcile.undecided(note)
        with contextlib.suppress(LedgerUnavailable):
            await self.ledger.update(op.operation_id, change, self.clock())

    async def poll(self, op: Operation) -> Operation:
        """A poll is a touch: an expired lease turns UNKNOWN; a status-check tool then reconciles it;
        a wait for approval past its timeout expires."""
        op = await expiry.touch(self.ledger, op, self.clock(), self.tell, running=self.runs)
        if op.idempotency_class is not IdempotencyClass.KEY_AND_STATUS_CHECK:
            return op
        tool = self.tools.get(op.tool)
        if op.state is not State.UNKNOWN or tool is None or not tool.source.has_status_check:
            return op
        verdict, found, note = await self.status_check(tool, op)
        if verdict is Verdict.FOUND:
            return await self._record_reconciled(op, found, note)
        if verdict is Verdict.NOT_FOUND and await self._may_still_run(op):
            note = reconcile.too_soon(note)  # its attempt may still land: it stays UNKNOWN
        elif verdict is Verdict.NOT_FOUND:
            change = reconcile.not_found(op, note)
            return await self.ledger.update(op.operation_id, change, self.clock()) or await self.reread(op)
        await self._note_reconciliation(op, note)
        return await self.reread(op)

    async def _may_still_run(self, op: Operation, lease: float | None = None) -> bool:
        """Whether the operation's latest attempt may still be running, here or in another process.

        Only an attempt whose owner stopped recording (its lease lapsed) can be: an owner that
        recorded UNKNOWN itself did so once its attempt ended. Its owner started it within its lease
        of the take and runs it at most its timeout, so it is over once the take is older than both
        (on the ledger's clock: never this process's wall clock, which may have stepped), or when
        its owner is known to be gone.
        """
        if self.runs.owns(op.operation_id):
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
        lease = lease or self.settings.lease  # the call's, or the current one for a poll
        timeout = tool.policy.timeout if tool is not None else lease
        return start.age < lease + timeout + ATTEMPT_SLACK

    # --- lifecycle: lease renewal, lease expiry, retention (duties.py) -------------------------------

    def running(
        self, *, sweep_every: float | None = None, purge_every: float = 60.0
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """Background duties while serving; on exit, in-flight work gets a moment to record its outcome."""
        return duties.running(
            self.runs, self.settings.lease, sweep_every=sweep_every, purge_every=purge_every
        )

    async def drain(self, timeout: float = 10.0) -> None:
        await self.runs.drain(timeout)


class _ClaimAgain(Enum):
    """`_on_existing`'s answer when the call must go through the claim once more."""

    CLAIM_AGAIN = "claim again"


_CLAIM_AGAIN = _ClaimAgain.CLAIM_AGAIN


def _missing_key(tool: GuardedTool) -> str:
    """The gateway checks keys first; a keyed call without one reaching here is still refused."""
    raise errors.key_required(tool.name)
