"""The ledger interface: a small surface every backend implements the same way.

Callers (the commit boundary, the meta tools, the CLI) speak only this; the
SQLite and PostgreSQL backends live behind it. Each method is one ledger step
and, in the backends, one round trip.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from enum import StrEnum
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

from commitgate.server.model.audit import Actor, AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ApprovalRecord, BudgetFigures, ErrorRecord, ReconciliationNote
from commitgate.server.model.records import Operation, ToolResult

# The error recorded on an operation whose owner stopped before recording its outcome.
LEASE_LOST = ErrorRecord(
    code="lease_expired", message="the process running this operation stopped before recording its outcome"
)


class LedgerUnavailable(Exception):
    """The ledger could not be read or written; keyed tools fail closed."""


class ClaimKind(StrEnum):
    NEW = "new"  # the caller owns a fresh RUNNING attempt and must execute it
    EXISTING = "existing"  # someone already recorded this operation; read its state
    CONFLICT = "conflict"  # the key was first used with another tool or other arguments
    DUPLICATE = "duplicate"  # a new key, but the same action was recorded recently: nothing claimed
    AWAITING = "awaiting"  # a new key recorded AWAITING_APPROVAL: nothing runs before a person decides


# States of an earlier operation that make a fresh-key call with the same arguments a possible
# duplicate: it happened, may have happened, or is about to. (AWAITING_APPROVAL: an action a
# person has yet to approve.)
DUPLICATE_STATES = (State.PENDING, State.RUNNING, State.SUCCEEDED, State.UNKNOWN, State.AWAITING_APPROVAL)


@dataclass(frozen=True, slots=True)
class DuplicateCheck:
    """Look, inside the claim, for the same action recorded under another key.

    The lookup and the insert are one atomic ledger step, so of N identical calls with N fresh
    keys exactly one is claimed. A match is answered with `ClaimKind.DUPLICATE` when `reject`;
    otherwise the call is claimed and the match recorded in its audit trail.
    """

    window_seconds: float
    any_session: bool  # scope "principal": every session of the principal; else the same session
    reject: bool
    confirmed: bool = False  # the caller said it means a second action (recorded with the match)


# States of an operation whose amount its budget counts: it happened, may have happened, or is
# about to. An operation spends when it is taken to run (its `budget_spent_at` is set then): one
# approved and still PENDING does not count yet, and the take, not the creation, places it in the
# window. A budget gives back only what certainly did not run or was undone: FAILED_RETRYABLE
# (failed before any effect), COMPENSATED, and a FAILED_FINAL that was never taken (a denial, an
# expiry, a take refused for its budget: `budget_spent_at` stays NULL). A FAILED_FINAL that ran
# keeps counting: nothing proves its effect did not happen.
BUDGET_STATES = (State.PENDING, State.RUNNING, State.SUCCEEDED, State.UNKNOWN, State.FAILED_FINAL)


def sql_states(states: Iterable[State]) -> str:
    """States as SQL string literals for `state IN (...)`: our own fixed values, never a caller's."""
    return ", ".join(f"'{state.value}'" for state in states)


def sql_state(state: State) -> str:
    """One state as an SQL string literal, for `state = ...`."""
    return sql_states((state,))


@dataclass(frozen=True, slots=True)
class BudgetCheck:
    """Spend `amount` of a budget inside the claim, if it fits.

    The ledger adds up the amounts of the budget's operations in scope that spent within the window
    (in BUDGET_STATES) and claims only when that sum plus `amount` stays within `limit`; the sum
    and the insert are one atomic step, so concurrent calls can never jointly overspend.
    Otherwise `claim` raises `OverBudget` and records nothing. The same check goes with the take of
    an approved operation (`Transition.budget`): there too the sum and the take are one step.
    """

    name: str
    per: str  # "principal" | "session" | "all": which operations share the budget
    amount: Decimal
    limit: Decimal
    window_seconds: float
    # `exceeded = "approval"`: the approval record a call that does not fit waits with. The ledger
    # then records it AWAITING_APPROVAL instead of refusing it, adding `over_budget` (below)
    # to the record and to the audit, so the person deciding sees what approving overspends.
    approval: ApprovalRecord | None = None
    unit: str | None = None


def over_budget(check: BudgetCheck, spent: Decimal) -> BudgetFigures:
    """What a person approving an over-budget call reads: the budget, its limit, what is spent, the call's amount."""
    return BudgetFigures(check.name, check.limit, spent, check.amount, check.unit or None)


def over_budget_wait(check: BudgetCheck, own: ApprovalRecord | None, spent: Decimal) -> ApprovalRecord:
    """The approval record of a call that waits because it is past its budget: the tool's own record
    if it needs approval anyway, else the budget's; either way decided by operators only (the agent's
    client never approves its own overspend), with what approving overspends."""
    assert check.approval is not None
    return dataclasses.replace(
        own or check.approval, deciders=check.approval.deciders, over_budget=over_budget(check, spent)
    )


class OverBudget(Exception):
    """The claim (or take) would take its budget past the limit; nothing was recorded (taken)."""

    def __init__(self, spent: Decimal) -> None:
        super().__init__(f"already spent {spent}")
        self.spent = spent


@dataclass(frozen=True, slots=True)
class Spent:
    """What one scope of a budget has spent within the window: `principal` and `session` are set as
    far as the budget's `per` separates them (both None for "all")."""

    principal: str | None
    session: str | None
    spent: Decimal
    operations: int

    @property
    def scope(self) -> str:
        return scope_name(self.principal, self.session)


@dataclass(frozen=True, slots=True)
class SpentIn:
    """What a budget's operations in one span of time spent: the span starts at `start` (a multiple
    of the span's length since the epoch, so spans fall on whole hours or UTC days)."""

    start: float
    spent: Decimal
    operations: int


def scope_name(principal: str | None, session: str | None) -> str:
    """A scope as people read it: "all", the principal, or "principal/session"."""
    if principal is None:
        return "all"
    return principal if session is None else f"{principal}/{session}"


def scope_of(per: str, principal: str, session: str) -> tuple[str | None, str | None]:
    """The (principal, session) a call's spending counts under."""
    if per == "all":
        return None, None
    return (principal, None) if per == "principal" else (principal, session)


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    principal: str
    session: str
    step: str
    tool: str
    idempotency_class: IdempotencyClass
    fingerprint: str
    arguments_json: str
    owner: str
    lease_seconds: float
    retention_seconds: float
    duplicates: DuplicateCheck | None = None
    # Set when this call needs a person's approval: a new key is then recorded AWAITING_APPROVAL
    # (no attempt, no lease) with this record, whose `expires_at` ends the wait.
    approval: ApprovalRecord | None = None
    budget: BudgetCheck | None = None
    # `arguments_json` decoded, when the caller holds it: the new operation takes it instead of
    # decoding the text that was just encoded from it.
    arguments: dict[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Claim:
    kind: ClaimKind
    operation: Operation  # for DUPLICATE: the earlier operation
    duplicate_of: str | None = None  # NEW despite a match (allowed or confirmed): the match's operation_id


@dataclass(frozen=True, slots=True)
class Lease:
    owner: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class AttemptStart:
    """When an operation's latest attempt was taken, on the ledger's own clock, and by whom.

    `age` is measured where the start was recorded, never on a caller's wall clock: the SQLite
    ledger (one host) keeps the host's monotonic clock, PostgreSQL its server's clock. So another
    process can tell whether that attempt may still be running even if its own wall clock stepped.
    """

    owner: str | None
    age: float  # seconds since the take


@dataclass(frozen=True, slots=True)
class Transition:
    """A compare-and-set on one operation, recorded in the audit trail.

    It applies only while the operation is in one of `expect_states` and, when
    `expect_fence` is set, still carries that fencing token: a stale owner can
    never overwrite a newer attempt's outcome.
    """

    to_state: State
    expect_states: frozenset[State]
    event: AuditEvent
    expect_fence: int | None = None
    result: ToolResult | None = None
    error: ErrorRecord | None = None
    reconciliation: ReconciliationNote | None = None
    lease: Lease | None = None  # set => a new attempt: fence + 1, attempts + 1
    actor: Actor | None = None  # who made it; None: the ledger tells by its event (Actor.of_record)
    detail: dict[str, Any] | None = None
    approval: ApprovalRecord | None = None  # replaces the operation's approval record (a decision)
    # The take of an approved (PENDING) operation of a budgeted tool: the ledger checks the budget
    # with the take, atomically, and spends then; no room raises OverBudget and takes nothing. An
    # operation approved because it was past its budget is not checked again (a person saw the
    # figures), and one that spent already (a record from before spending moved to the take) neither.
    budget: BudgetCheck | None = None


@dataclass(frozen=True, slots=True)
class OperationFilter:
    principal: str | None  # None only for operators (CLI)
    session: str | None = None
    state: State | None = None
    tool: str | None = None
    older_than: float | None = None
    limit: int = 50
    step: str | None = None  # the idempotency key
    approval_due_by: float | None = None  # waits for approval that run out by then (the sweep's)


@dataclass(frozen=True, slots=True)
class Counts:
    """What the ledger holds now: operations by state (every state present), audit records by event."""

    states: dict[str, int]
    events: dict[str, int]


@dataclass(frozen=True, slots=True)
class AuditEntry:
    at: float
    event: str
    from_state: str | None
    to_state: str | None
    fence: int
    actor: str | None
    detail: dict[str, Any] | None = field(default=None)


# Told each ledger step's name and how long it took, in seconds (the metrics' ledger latency).
StepTimer = Callable[[str, float], None]


class Ledger(Protocol):
    """A durable operation ledger; see docs/contract.md#operation-states and docs/contract.md#guarantees."""

    # Set by whoever measures the ledger; each backend's steps report to it (`timed`).
    timer: StepTimer | None

    async def claim(self, request: ClaimRequest, now: float) -> Claim:
        """Claim the request's operation; raises OverBudget (recording nothing) when it carries a
        budget check that it would fail, for a key not seen before or a retryable one taken again,
        unless the check carries an approval record: then the operation waits for a person
        (ClaimKind.AWAITING), its approval record holding `over_budget`."""
        ...

    async def update(
        self, operation_id: str, change: Transition, now: float, *, current: Operation | None = None
    ) -> Operation | None:
        """Apply `change`; None when its expectations no longer hold. A change carrying a budget check
        (the take of an approved operation) raises OverBudget, taking nothing, when the budget has no room.

        `current` is the operation as the caller last got it from the ledger at the change's
        fence: a backend may use it instead of reading the row again (it never weakens a check).
        """
        ...

    async def renew_lease(self, operation_id: str, fence: int, lease: Lease) -> bool: ...

    async def attempt_start(self, operation_id: str, fence: int) -> AttemptStart | None:
        """When the attempt at `fence` was taken; None when the operation is at another fence or
        the ledger has no start for it (recorded before starts were kept)."""
        ...

    async def get(self, principal: str, session: str, step: str) -> Operation | None: ...

    async def get_by_id(self, principal: str | None, operation_id: str) -> Operation | None: ...

    async def find(self, where: OperationFilter) -> list[Operation]: ...

    async def history(self, operation_id: str) -> list[AuditEntry]: ...

    async def expire_leases(self, now: float) -> Sequence[Operation]:
        """Turn RUNNING operations whose lease ran out into UNKNOWN; return them."""
        ...

    async def purge(self, now: float) -> int:
        """Delete completed operations past their retention; UNKNOWN is never purged."""
        ...

    async def counts(self) -> Counts:
        """Operations by state, and audit records by event."""
        ...

    async def budget_spent(self, budget: str, per: str, since: float, now: float) -> list[Spent]:
        """What each scope of `budget` spent since `since` (scopes with nothing spent left out)."""
        ...

    async def budget_spending(
        self,
        budget: str,
        principal: str | None,
        session: str | None,
        since: float,
        now: float,
        span_seconds: float,
    ) -> list[SpentIn]:
        """What `budget` spent since `since` per span of `span_seconds`, oldest first (spans with nothing
        spent left out), counting what `budget_spent` counts: only `principal`'s operations when given,
        and only `session`'s when given too. Read-only."""
        ...

    async def tool_definitions(self, upstreams: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
        """The latest definition each of `upstreams` gave of each of its tools (tool_definitions.py)."""
        ...

    async def record_tool_definitions(
        self, upstream: str, tools: dict[str, dict[str, Any]], now: float
    ) -> None:
        """Replace what is kept of `upstream`'s tools with `tools` (name -> definition, wire JSON)."""
        ...

    async def check_writable(self) -> None: ...

    async def close(self) -> None: ...


# --- lease owners --------------------------------------------------------------

_HOST = socket.gethostname()
_PROCESS_NONCE = uuid.uuid4().hex[:8]


def this_owner() -> str:
    """Identifies this process as a lease owner: host, pid and a nonce against pid reuse."""
    return f"{_HOST}:{os.getpid()}:{_PROCESS_NONCE}"


def owner_known_dead(owner: str | None) -> bool:
    """True only when the owner ran on this host and its process is gone (docs/contract.md#leases)."""
    if not owner:
        return False
    host, _, rest = owner.partition(":")
    pid_text, _, nonce = rest.partition(":")
    if host != _HOST or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return nonce != _PROCESS_NONCE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def lease_over(op: Operation, now: float) -> bool:
    """A RUNNING operation whose owner can no longer record its outcome."""
    return op.state is State.RUNNING and (
        (op.lease_expires_at is not None and op.lease_expires_at <= now) or owner_known_dead(op.lease_owner)
    )


def is_outcome(change: Transition) -> bool:
    """The outcome of an attempt: a running operation's final state. Lost (a power loss before its
    sync), it leaves the operation RUNNING, which its lease turns UNKNOWN: never run twice. So it
    may wait for a later sync under `[ledger] durability = "claim"`."""
    final = change.to_state.terminal or change.to_state is State.UNKNOWN
    return final and change.expect_states == frozenset({State.RUNNING}) and change.lease is None


class _Timeable(Protocol):
    timer: StepTimer | None


_L = TypeVar("_L", bound=_Timeable)
_P = ParamSpec("_P")
_T = TypeVar("_T")


_Step = TypeVar("_Step", bound=Callable[..., Coroutine[Any, Any, Any]])


def timed(step: _Step) -> _Step:
    """`_timed`, giving back the step's own type: mypy names an `async def`'s result `Coroutine` and
    pyright `CoroutineType`, so a rebuilt signature would match the `Ledger` protocol for one only."""
    return cast(_Step, _timed(step))


def _timed(
    step: Callable[Concatenate[_L, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[_L, _P], Coroutine[Any, Any, _T]]:
    """A backend's ledger step that reports its latency, awaited in full, to the ledger's `timer`.
    Without a timer the call is the step's own coroutine: nothing is added to it."""
    name = step.__name__

    async def timing(ledger: _L, timer: StepTimer, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        start = time.perf_counter()
        try:
            return await step(ledger, *args, **kwargs)
        finally:
            timer(name, time.perf_counter() - start)

    @functools.wraps(step)
    def call(ledger: _L, *args: _P.args, **kwargs: _P.kwargs) -> Coroutine[Any, Any, _T]:
        timer = ledger.timer
        if timer is None:
            return step(ledger, *args, **kwargs)
        return timing(ledger, timer, *args, **kwargs)

    return call
