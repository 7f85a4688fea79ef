"""`[budgets.NAME]`: a cap on what the calls of some tools may spend within a sliding window.

A budget adds up a CEL `amount` over its recent operations; a call that would take the sum past
`limit` is refused with `budget_exceeded` before anything runs, or with `exceeded = "approval"`
waits for a person to decide. Keyed tools name it with
`budget = "NAME"` (docs/policy.md#budgets).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from commitgate.server.model.amounts import NotAnAmount, amount, number
from commitgate.server.model.durations import (
    DURATION_PATTERN,
    format_duration,
    parse_duration,
    parse_written_duration,
)
from commitgate.server.policy.expressions import CelExpression

Per = Literal["principal", "session", "all"]


class BudgetPolicy(BaseModel):
    """What one budget counts, how much it allows, over how long, and for whom."""

    model_config = ConfigDict(extra="forbid")

    amount: CelExpression = Field(
        description="CEL giving the number a call spends, e.g. 'arguments.amount_cents'.",
        json_schema_extra={"examples": ["arguments.amount_cents"]},
    )
    limit: Annotated[
        Decimal,
        PlainSerializer(number, when_used="json"),
        WithJsonSchema({"type": "number", "minimum": 0, "examples": [100000, 0.3]}),
    ] = Field(
        ge=0,
        description="The most that may be spent within the window, per scope (exact decimals, up to 9 places).",
    )
    window: Annotated[
        float,
        PlainSerializer(lambda seconds: format_duration(seconds), return_type=str, when_used="json"),
        WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "examples": ["24h", "30d"]}),
    ] = Field(gt=0, description="How far back spending counts (a sliding window), e.g. '30d'.")
    per: Per = Field(
        "principal",
        description="'principal': each caller has its own budget; 'session': each session of each caller; "
        "'all': one budget for everyone.",
    )
    exceeded: Literal["reject", "approval"] = Field(
        "reject",
        description="'reject': answer budget_exceeded and execute nothing; 'approval': record the call "
        "AWAITING_APPROVAL and let an operator decide whether to spend past the limit.",
    )
    unit: str | None = Field(
        None,
        min_length=1,
        max_length=40,
        description="What the amounts count, shown with every figure of the budget, e.g. 'USD cents'.",
        json_schema_extra={"examples": ["USD cents", "EUR", "tokens"]},
    )

    @field_validator("window", mode="before")
    @classmethod
    def _duration(cls, value: Any, info: ValidationInfo) -> float:
        written = bool(info.context and info.context.get("written"))
        return parse_written_duration(value) if written else parse_duration(value)

    @field_validator("limit", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, Decimal):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            shown = f" (got {value!r})" if isinstance(value, str | bool) and len(str(value)) <= 40 else ""
            raise ValueError(f"must be a number, e.g. 100000{shown}")
        try:
            return amount(value)
        except NotAnAmount as exc:
            raise ValueError(str(exc)) from None
