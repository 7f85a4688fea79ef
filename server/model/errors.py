"""The one error type commands print as a single line: a user's mistake or the environment's refusal."""

from __future__ import annotations


class UserFacingError(Exception):
    """Said to the person at the terminal in one line (no traceback): what is wrong and what to do."""
