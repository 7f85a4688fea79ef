"""The names of the ledger's audit records: one per kind of change an operation goes through, and
who made each change (`Actor`).

The ledger stores them as text, and the PostgreSQL functions write some of them in SQL; a test
holds those SQL texts to this list, so a name cannot drift between the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class AuditEvent(StrEnum):
    """Why an operation changed, as its audit trail and `commitgate ops stats` name it."""

    # an attempt begins
    CLAIMED = "claimed"  # a key not seen before: its first attempt
    RETRY_CLAIMED = "retry_claimed"  # a FAILED_RETRYABLE operation taken again by a new call of its key
    RERUN_CLAIMED = "rerun_claimed"  # an UNKNOWN or FAILED_RETRYABLE one run again: certainly not applied
    APPROVED_CLAIMED = "approved_claimed"  # an approved (PENDING) operation taken to run
    RETRY = "retry"  # another attempt within the same call, after a transient failure
    # an attempt's outcome
    SUCCEEDED = "succeeded"
    FAILED_FINAL = "failed_final"
    AMBIGUOUS = "ambiguous"  # it may or may not have applied: UNKNOWN
    RETRIES_EXHAUSTED = "retries_exhausted"
    LATE_OUTCOME = "late_outcome"  # recorded by its owner after its lease had run out
    LEASE_EXPIRED = "lease_expired"  # its owner stopped answering: UNKNOWN
    # before anything runs
    APPROVAL_REQUESTED = "approval_requested"  # recorded AWAITING_APPROVAL: a person decides first
    POSSIBLE_DUPLICATE = "possible_duplicate"  # recorded although the same action is recent (allowed)
    BUDGET_EXCEEDED = "budget_exceeded"  # past its budget: waits for a person, or refused at its take
    # a person's decision
    APPROVED = "approved"
    DENIED = "denied"
    APPROVAL_EXPIRED = "approval_expired"  # nobody decided before the timeout
    # an outcome of unknown state settled
    RECONCILED_FOUND = "reconciled_found"
    RECONCILED_NOT_FOUND = "reconciled_not_found"
    RECONCILE_UNDECIDED = "reconcile_undecided"  # the status check could not tell: still UNKNOWN
    RESOLVED = "resolved"  # an operator said how it ended
    COMPENSATED = "compensated"  # undone by its compensation


# --- who acted ------------------------------------------------------------------------------------


class ActorRole(StrEnum):
    """The three kinds of actor an audit record names."""

    PRINCIPAL = "principal"  # the agent's call (its claim, its first attempt, its compensation)
    COMMITGATE = "commitgate"  # commitgate on its own: an automatic retry, a sweep, its status check
    OPERATOR = "operator"  # a person's decision: an approval, a denial, a resolution, a check asked for


# Events only commitgate causes, whoever's call came upon them; an audit record without an actor
# (written by the ledger itself, or before actors were recorded) of such an event is commitgate's.
AUTOMATIC_EVENTS = frozenset(
    {
        AuditEvent.RETRY,
        AuditEvent.LATE_OUTCOME,
        AuditEvent.LEASE_EXPIRED,
        AuditEvent.APPROVAL_EXPIRED,
        AuditEvent.RECONCILED_FOUND,
        AuditEvent.RECONCILED_NOT_FOUND,
        AuditEvent.RECONCILE_UNDECIDED,
    }
)

# A server process's lease owner id, "host:pid:nonce": the ledger records it for a claim, the
# principal's call.
_OWNER_ID = re.compile(r".+:\d+:[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class Actor:
    """Who made a transition: stored in the audit record's `actor` as `str(actor)`
    (`principal:NAME`, `operator:NAME` or `commitgate`) and read back with `Actor.of_record`."""

    role: ActorRole
    name: str

    @classmethod
    def principal(cls, name: str) -> Actor:
        return cls(ActorRole.PRINCIPAL, name)

    @classmethod
    def operator(cls, name: str) -> Actor:
        return cls(ActorRole.OPERATOR, name)

    def __str__(self) -> str:
        # A StrEnum formats as its value without the Python call `.value` costs: once per write.
        return self.name if self.role is ActorRole.COMMITGATE else f"{self.role}:{self.name}"

    @property
    def shown(self) -> str:
        """For people: `alice (principal)`, `commitgate`, `bob (operator)`."""
        return self.name if self.role is ActorRole.COMMITGATE else f"{self.name} ({self.role.value})"

    @classmethod
    def of_record(cls, recorded: str | None, event: str, principal: str) -> Actor:
        """The actor of an audit record of `event` on an operation of `principal`."""
        if recorded == COMMITGATE.name:
            return COMMITGATE
        role, _, name = (recorded or "").partition(":")
        if role in (ActorRole.PRINCIPAL, ActorRole.OPERATOR) and name:
            return cls(ActorRole(role), name)
        if not recorded or _OWNER_ID.fullmatch(recorded):
            return COMMITGATE if event in AUTOMATIC_EVENTS else cls.principal(principal)
        return cls.operator(recorded)  # a bare name: a person's decision, recorded before roles were


COMMITGATE = Actor(ActorRole.COMMITGATE, "commitgate")


def recorded_actor(actor: Actor | None) -> str | None:
    """What the ledger stores in the audit record's `actor` column."""
    return None if actor is None else str(actor)
