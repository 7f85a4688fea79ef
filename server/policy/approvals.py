"""The `approval` option of a keyed tool: a person says yes before the effect.

`when` is a CEL expression over the call (docs/policy.md#approval); a call for which it holds
is recorded as AWAITING_APPROVAL and runs only once someone listed in `via` approved it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from commitgate.server.model.durations import DURATION_PATTERN, parse_duration
from commitgate.server.policy.expressions import CelExpression, compile_expression

DEFAULT_TIMEOUT = 86400.0
Decider = Literal["client", "operator"]
DECIDERS: tuple[Decider, ...] = ("client", "operator")


class ApprovalPolicy(BaseModel):
    """Who must say yes, to which calls, and for how long the question stays open."""

    model_config = ConfigDict(extra="forbid")

    when: CelExpression = Field(
        default_factory=lambda: compile_expression("true"),
        description="A CEL expression over arguments, principal, session, tool: the calls that need "
        'approval (default "true": every call).',
        json_schema_extra={"examples": ["arguments.amount_cents > 10000"]},
    )
    timeout: Annotated[
        float,
        WithJsonSchema(
            {"type": "string", "pattern": DURATION_PATTERN, "default": "24h", "examples": ["15m", "24h"]}
        ),
    ] = Field(
        DEFAULT_TIMEOUT,
        gt=0,
        description="How long a call may wait for a decision before it fails with approval_expired.",
        json_schema_extra={"default": "24h"},
    )
    via: list[Decider] = Field(
        default_factory=lambda: list(DECIDERS),
        min_length=1,
        description="Who may decide: 'client' (the client's user, asked within the call when the client "
        "supports elicitation) and 'operator' (commitgate ops approve|deny).",
    )
    prompt: str | None = Field(
        None,
        max_length=2000,
        description="What the person is asked; may use {arguments.X}.",
    )

    @field_validator("timeout", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)

    @field_validator("via")
    @classmethod
    def _distinct(cls, value: list[Decider]) -> list[Decider]:
        if len(set(value)) != len(value):
            raise ValueError("list each decider once")
        return value

    def by(self, via: str) -> bool:
        return via in self.via
