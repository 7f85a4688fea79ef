"""The four idempotency classes as decision tables (docs/contract.md#idempotency-classes).

Three questions, three tables, no scattered `if`s:
  * an attempt ended with an outcome: what next?            -> `after_attempt`
  * a call found the operation already recorded: what now?  -> `on_existing`
  * a client polls: what should it do?                      -> `retry_advice`

The same tables, in words: docs/contract.md#operation-states and docs/contract.md#retry-advice.
"""

from __future__ import annotations

from enum import StrEnum

from commitgate.server.model.facts import IdempotencyClass, RetryAdvice, State
from commitgate.server.model.outcomes import Outcome

C = IdempotencyClass


class Next(StrEnum):
    RECORD_SUCCESS = "record_success"
    RETRY = "retry"  # run again with the same key if attempts and deadline allow
    RECONCILE = "reconcile"  # ask the status check
    RECORD_UNKNOWN = "record_unknown"
    RECORD_FAILED_FINAL = "record_failed_final"


# (class, outcome, forwards_key) -> next step. RETRY that runs out of attempts
# ends FAILED_RETRYABLE when the failure was certainly before any effect, and
# UNKNOWN when it was ambiguous (see `exhausted_state`).
_AFTER_ATTEMPT: dict[tuple[IdempotencyClass, Outcome, bool], Next] = {}
for _cls in IdempotencyClass:
    for _fwd in (False, True):
        _AFTER_ATTEMPT[(_cls, Outcome.SUCCESS, _fwd)] = Next.RECORD_SUCCESS
        _AFTER_ATTEMPT[(_cls, Outcome.RETRYABLE, _fwd)] = Next.RETRY
        _AFTER_ATTEMPT[(_cls, Outcome.PERMANENT, _fwd)] = Next.RECORD_FAILED_FINAL
_AFTER_ATTEMPT.update(
    {
        (C.SAFE_RETRY, Outcome.AMBIGUOUS, False): Next.RETRY,
        (C.SAFE_RETRY, Outcome.AMBIGUOUS, True): Next.RETRY,
        (C.KEY_REQUIRED, Outcome.AMBIGUOUS, False): Next.RECORD_UNKNOWN,
        (C.KEY_REQUIRED, Outcome.AMBIGUOUS, True): Next.RETRY,  # downstream dedups on the same key
        (C.KEY_AND_STATUS_CHECK, Outcome.AMBIGUOUS, False): Next.RECONCILE,
        (C.KEY_AND_STATUS_CHECK, Outcome.AMBIGUOUS, True): Next.RECONCILE,
        (C.COMPENSABLE, Outcome.AMBIGUOUS, False): Next.RECORD_UNKNOWN,  # never retried forward
        (C.COMPENSABLE, Outcome.AMBIGUOUS, True): Next.RECORD_UNKNOWN,
    }
)


def after_attempt(cls: IdempotencyClass, outcome: Outcome, forwards_key: bool) -> Next:
    return _AFTER_ATTEMPT[(cls, outcome, forwards_key)]


def exhausted_state(last_outcome: Outcome, *, maybe_applied: bool = False) -> State:
    """Out of attempts: retryable only when no attempt of this operation may have taken effect."""
    return (
        State.FAILED_RETRYABLE if last_outcome is Outcome.RETRYABLE and not maybe_applied else State.UNKNOWN
    )


class OnExisting(StrEnum):
    REPLAY = "replay"  # return the recorded result
    FAIL = "fail"  # replay the recorded failure
    WAIT = "wait"  # someone runs it now: wait, then answer from the ledger
    RECONCILE = "reconcile"  # ask the status check before anything else
    RERUN = "rerun"  # provably safe to run again with the same key
    AWAIT = "await"  # a person has yet to decide: nothing runs
    TAKE = "take"  # approved, not started: this call runs it (one caller wins the take)
    UNKNOWN = "unknown"  # may or may not have happened: never re-run blindly


def on_existing(cls: IdempotencyClass, state: State, forwards_key: bool) -> OnExisting:
    if state in (State.SUCCEEDED, State.COMPENSATED):
        return OnExisting.REPLAY
    if state is State.FAILED_FINAL:
        return OnExisting.FAIL
    if state is State.AWAITING_APPROVAL:
        return OnExisting.AWAIT
    if state is State.PENDING:
        return OnExisting.TAKE
    if state is State.RUNNING:
        return OnExisting.WAIT
    if state is State.FAILED_RETRYABLE:
        return OnExisting.RERUN
    # UNKNOWN
    if cls is C.KEY_AND_STATUS_CHECK:
        return OnExisting.RECONCILE
    if cls is C.KEY_REQUIRED and forwards_key:
        return OnExisting.RERUN
    return OnExisting.UNKNOWN


def retry_advice(cls: IdempotencyClass, state: State, forwards_key: bool, lease_live: bool) -> RetryAdvice:
    if state in (State.SUCCEEDED, State.COMPENSATED):
        return RetryAdvice.DONE
    if state is State.FAILED_FINAL:
        return RetryAdvice.DO_NOT_RETRY
    if state is State.FAILED_RETRYABLE:
        return RetryAdvice.SAFE_TO_RETRY_SAME_KEY
    if state is State.AWAITING_APPROVAL:
        return RetryAdvice.WAIT_AND_POLL
    if state is State.PENDING:  # approved and not started: the same key and arguments run it once
        return RetryAdvice.SAFE_TO_RETRY_SAME_KEY
    if state is State.RUNNING and lease_live:
        return RetryAdvice.WAIT_AND_POLL
    if state is State.RUNNING:  # lease ran out: about to become UNKNOWN
        return RetryAdvice.WAIT_AND_POLL if cls is C.KEY_AND_STATUS_CHECK else RetryAdvice.DO_NOT_RETRY
    # UNKNOWN: re-running is safe only when the downstream dedups on our key
    if cls in (C.KEY_REQUIRED, C.KEY_AND_STATUS_CHECK) and forwards_key:
        return RetryAdvice.SAFE_TO_RETRY_SAME_KEY
    return RetryAdvice.DO_NOT_RETRY
