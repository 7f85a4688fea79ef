"""The `duplicates` option of a keyed tool: catching the same action re-issued under a fresh key.

A model that lost its context, or a workflow restarted under a new run id, calls again with a
new key; the key cannot catch that, the arguments can. The option is on by default for every
keyed tool; `duplicates = false` turns it off (docs/policy.md#duplicates).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from commitgate.server.model.durations import format_duration, parse_duration

DEFAULT_WINDOW = 600.0


class DuplicatesPolicy(BaseModel):
    """How a call with a new key but the same tool and arguments as a recent operation is treated."""

    model_config = ConfigDict(extra="forbid")

    window: float = Field(
        DEFAULT_WINDOW,
        gt=0,
        description="How far back an earlier operation counts as the same action, e.g. '10m'.",
        json_schema_extra={"examples": ["10m", "1h"]},
    )
    scope: Literal["session", "principal"] = Field(
        "session",
        description="'session': the same principal and session; 'principal': any session of the principal.",
    )
    action: Literal["reject", "approval", "allow"] = Field(
        "reject",
        description="'reject': answer possible_duplicate and execute nothing; 'approval': a person decides "
        "(the earlier operation is shown); 'allow': execute and only record the match in the audit trail.",
    )

    @field_validator("window", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)


def duplicates_shorthand(value: Any) -> Any:
    """`duplicates = false` turns detection off (None); `true` keeps the defaults."""
    if value is False:
        return None
    if value is True:
        return {}
    return value


def window_warning(where: str, duplicates: DuplicatesPolicy | None, retention: float) -> str | None:
    """A window longer than the tool's retention: the earlier record may be purged before it ends."""
    if duplicates is None or duplicates.window <= retention:
        return None
    return (
        f"{where}.duplicates.window: {format_duration(duplicates.window)} is longer than the tool's retention "
        f"({format_duration(retention)}); a record purged earlier no longer catches a duplicate"
    )
