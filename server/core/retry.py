"""Backoff with full jitter, and the outcome of one attempt."""

from __future__ import annotations

import random
from dataclasses import dataclass

from commitgate.server.model.notes import ErrorRecord
from commitgate.server.model.outcomes import Outcome, PermanentError, RetryableError, ToolOutcomeError
from commitgate.server.policy.models import RetryPolicy


def classify(exc: BaseException) -> Outcome:
    """Any exception that is not one of the three declared outcomes counts as ambiguous."""
    if isinstance(exc, RetryableError):
        return Outcome.RETRYABLE
    if isinstance(exc, PermanentError):
        return Outcome.PERMANENT
    return Outcome.AMBIGUOUS  # AmbiguousError, and anything undeclared


def error_record(exc: BaseException, outcome: Outcome) -> ErrorRecord:
    """What the ledger keeps of a failure: its kind and message, never the arguments."""
    message = exc.message if isinstance(exc, ToolOutcomeError) else (str(exc) or type(exc).__name__)
    if isinstance(exc, TimeoutError):
        message = "the tool did not answer within its timeout"
    detail = exc.detail if isinstance(exc, ToolOutcomeError) else None
    return ErrorRecord(outcome=outcome.value, type=type(exc).__name__, message=message, detail=detail)


@dataclass(slots=True)
class Backoff:
    policy: RetryPolicy
    rng: random.Random

    def delay(self, failed_attempt: int, retry_after: float | None = None) -> float:
        """Delay before the attempt after `failed_attempt` (1-based); `Retry-After` is a floor."""
        cap = min(self.policy.max, self.policy.initial * self.policy.multiplier ** (failed_attempt - 1))
        delay = self.rng.uniform(0.0, cap) if self.policy.jitter == "full" else cap
        if retry_after is not None:
            delay = max(delay, retry_after)
        return delay
