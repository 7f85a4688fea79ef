"""The names of the ledger's audit records: one per kind of change an operation goes through.

The ledger stores them as text, and the PostgreSQL functions write some of them in SQL; a test
holds those SQL texts to this list, so a name cannot drift between the two.
"""

from __future__ import annotations

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
