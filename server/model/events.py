"""What the commit boundary and the gateway tell their observers (metrics, logs, traces), and the
observers' shape: each is a callable given one frozen event per thing that happened."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from enum import StrEnum
from typing import Any, NamedTuple, Protocol

from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.outcomes import Outcome, Verdict
from commitgate.server.model.records import Operation


class Event(StrEnum):
    """A notable moment of a guarded call. Fields that come with it are named in the comment."""

    ATTEMPT = "attempt"  # one execution ended: outcome
    RETRY = "retry"  # another attempt follows a failed one
    REPLAY = "replay"  # answered from a recorded outcome
    CONFLICT = "conflict"  # a key reused with another tool or other arguments
    RECONCILIATION = "reconciliation"  # a status check answered: verdict
    LEASE_EXPIRED = "lease_expired"  # a RUNNING operation whose owner stopped became UNKNOWN
    COMPLETED = "completed"  # an outcome was recorded: state, seconds
    LEDGER_UNAVAILABLE = "ledger_unavailable"  # a keyed call refused: nothing executed
    RESULT_TOO_LARGE = "result_too_large"  # a result over the ledger's size limit
    POSSIBLE_DUPLICATE = "possible_duplicate"  # a fresh-key repeat of a recent operation, refused
    DUPLICATE_ALLOWED = "duplicate_allowed"  # a fresh-key repeat run anyway (allow, or confirmed)
    APPROVAL_REQUESTED = "approval_requested"  # a call recorded AWAITING_APPROVAL: operation_id
    APPROVAL_EXPIRED = "approval_expired"  # nobody decided in time: FAILED_FINAL, operation_id
    BUDGET_SPENT = "budget_spent"  # a call claimed an amount of a budget: budget, scope, amount
    BUDGET_EXCEEDED = (
        "budget_exceeded"  # a call past its budget's limit, refused or sent to a person: budget, scope
    )


class BoundaryEvent(NamedTuple):
    """One event as every observer receives it: built once, shared, never changed.

    A named tuple rather than a frozen dataclass: every guarded call builds two or more while
    observers listen, and a tuple is built in a fifth of the time.

    A field the event does not come with is None. None of them carries what a client sent
    (arguments, keys, sessions) or a message that may quote it, except `scope` (it may name a
    principal or a session) and `amount` (it comes from the arguments): observers that write
    things out leave those two to unredacted logs.
    """

    kind: Event
    tool: str
    cls: IdempotencyClass
    operation_id: str | None = None
    outcome: Outcome | None = None  # ATTEMPT
    verdict: Verdict | None = None  # RECONCILIATION
    state: State | None = None  # COMPLETED: the state recorded
    seconds: float | None = None  # COMPLETED: from the claim to the recorded outcome
    budget: str | None = None  # BUDGET_SPENT, BUDGET_EXCEEDED: the budget's name
    scope: str | None = None  # BUDGET_SPENT, BUDGET_EXCEEDED: whose spending (a principal, a session)
    amount: Decimal | None = None  # BUDGET_SPENT

    def details(self) -> dict[str, object]:
        """The fields this event comes with (the set ones past kind, tool and class), by name."""
        return {name: value for name in _DETAILS if (value := getattr(self, name)) is not None}


_DETAILS = BoundaryEvent._fields[3:]  # past kind, tool and class


class Observer(Protocol):
    """Called on every event; must be quick and must never raise (instrumentation cannot break a call)."""

    def __call__(self, event: BoundaryEvent) -> None: ...


# The codes of a call that has no error code of its own (docs/contract.md lists the others).
OK = "ok"
INPUT_REQUIRED = "input_required"  # a first round: the client calls again with the user's answer
PROTOCOL_ERROR = "protocol_error"  # a JSON-RPC error instead of a result (an unknown tool, a dropped answer)
CANCELLED = "cancelled"  # the client cancelled it, or the server stopped, before it was answered
OWN_ERROR = "error"  # an error result without a code (the fault plan's control tool)


class CallAnswered(NamedTuple):
    """One `tools/call`, however it ended: told once per call, when its answer is known.

    `code` is "ok", an error code, or one of the codes above. `message` (it may quote arguments)
    and `arguments` (what the client sent, the call's own mapping, not a copy) are written only
    by unredacted logs; `principal` never becomes a metric label or a span attribute.
    """

    tool: str  # "(unknown)" for a tool the policy does not offer: clients cannot grow the labels
    cls: str  # the tool's idempotency class, "meta" for a meta tool, "none" for an unknown one
    principal: str
    code: str
    seconds: float  # from the call's arrival at the gateway to its answer
    operation: Operation | None = None  # the operation the answer is about
    replayed: bool = False
    message: str | None = None
    arguments: Mapping[str, Any] | None = None


class CallObserver(Protocol):
    """Called once per call; must be quick and must never raise."""

    def __call__(self, event: CallAnswered) -> None: ...
