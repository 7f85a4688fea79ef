"""The outcome taxonomy a tool uses to say what happened to the world.

A tool raises one of these; any other exception counts as ambiguous for keyed
tools, because nobody can prove the side effect did not happen.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    """How one attempt ended, as the boundary decides what comes next."""

    SUCCESS = "success"
    RETRYABLE = "retryable"  # certainly not applied
    AMBIGUOUS = "ambiguous"  # may have been applied
    PERMANENT = "permanent"  # rejected, not applied


class Verdict(StrEnum):
    """What a status check said about an action: it took effect, it certainly did not, or nobody can tell."""

    FOUND = "found"
    NOT_FOUND = "not_found"
    CANNOT_TELL = "cannot_tell"


class ToolOutcomeError(Exception):
    """Base of the three outcomes a tool can signal."""

    def __init__(self, message: str = "", *, retry_after: float | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.message = message or type(self).__name__
        self.retry_after = retry_after
        self.detail = detail


class RetryableError(ToolOutcomeError):
    """Certainly not applied: the same key may safely execute again."""


class AmbiguousError(ToolOutcomeError):
    """May or may not have taken effect (timeout, dropped connection, lost acknowledgement)."""


class PermanentError(ToolOutcomeError):
    """Rejected by the system of record and not applied; repeating will not help."""
