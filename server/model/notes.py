"""What the ledger keeps beside an operation's result: why it failed (`ErrorRecord`), how its
unknown outcome was settled (`ReconciliationNote`), and a person's decision (`ApprovalRecord`,
with the `BudgetFigures` a call past its budget waits with).

Each is stored as one JSON object. `from_stored` and `stored` are the only conversions, used by
the ledger backends as they read and write a row: everything above the ledger reads attributes.
`stored` writes the keys in the order and with the presence they always had, so a record read
and written again is the same text; keys this version does not know are kept as they were read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, ClassVar, Self

from commitgate.server.model.amounts import decimal_of, number
from commitgate.server.model.facts import ApprovalState


def _present(record: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The fields of `record` named in `names` that are set, in that order."""
    return {name: value for name in names if (value := getattr(record, name)) is not None}


def _split(data: Mapping[str, Any], known: frozenset[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`data`'s keys that are fields, and the others (kept as `extra`)."""
    if data.keys() <= known:
        return dict(data), {}
    fields = {key: value for key, value in data.items() if key in known}
    return fields, {key: value for key, value in data.items() if key not in known}


class _Flat:
    """A record stored as its set fields, in `_ORDER`, followed by the keys it did not know."""

    __slots__ = ()
    _ORDER: ClassVar[tuple[str, ...]]
    _KEYS: ClassVar[frozenset[str]]
    extra: Mapping[str, Any]

    def stored(self) -> dict[str, Any]:
        return {**_present(self, self._ORDER), **self.extra}

    @classmethod
    def from_stored(cls, data: Mapping[str, Any]) -> Self:
        fields, extra = _split(data, cls._KEYS)
        make: Callable[..., Self] = cls  # the dataclass's own __init__, which this mixin cannot name
        return make(**fields, extra=extra)


@dataclass(frozen=True, slots=True)
class ErrorRecord(_Flat):
    """Why an operation failed or may have: a tool's failure (`outcome`, `type`, `message`,
    `detail`), or a refusal of the gate's own (`code`, `message`, and `budget` for a budget)."""

    message: str | None = None
    code: str | None = None  # an ErrorCode value, or "lease_expired"
    outcome: str | None = None  # an Outcome value: how the failure was classified
    type: str | None = None  # the exception's class name, or "OperatorResolution"
    detail: Any = None  # what the tool said about it (ToolOutcomeError.detail)
    # `error.budget` of a budget_exceeded recorded at its take: {name, limit, spent, window[, unit]}
    budget: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    _ORDER: ClassVar[tuple[str, ...]] = ("code", "outcome", "type", "message", "detail", "budget")
    _KEYS: ClassVar[frozenset[str]] = frozenset(_ORDER)


@dataclass(frozen=True, slots=True)
class ReconciliationNote(_Flat):
    """Who last tried to settle an operation's outcome, when, and what they found."""

    by: str | None = None  # "status_check" | "owner" | "operator"
    at: float | None = None
    verdict: str | None = None  # a Verdict value, "succeeded"/"failed", or the owner's state (lowercase)
    operator: str | None = None  # by = "operator": who
    reason: str | None = None  # by = "operator": why
    asked_by: str | None = None  # a status check asked from the console: who asked
    error: str | None = None  # a status check that failed: why it could not tell
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    _ORDER: ClassVar[tuple[str, ...]] = ("by", "operator", "reason", "at", "verdict", "asked_by", "error")
    _KEYS: ClassVar[frozenset[str]] = frozenset(_ORDER)


@dataclass(frozen=True, slots=True)
class BudgetFigures:
    """A budget's figures as a person deciding a call reads them: its `name`, `limit`, what its scope
    has `spent` within the window, the call's `amount`, and the budget's `unit` if it has one. Kept in
    the approval record of a call that waits past its budget (`exceeded = "approval"`): the figures it
    was sent to a person with. Stored as JSON numbers, read back exactly (docs/contract.md#budgets)."""

    name: str
    limit: Decimal
    spent: Decimal
    amount: Decimal
    unit: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def shown(self) -> dict[str, Any]:
        """`{name, limit, spent, amount[, unit]}`, as the status view gives it."""
        figures: dict[str, Any] = {
            "name": self.name,
            "limit": number(self.limit),
            "spent": number(self.spent),
            "amount": number(self.amount),
        }
        if self.unit is not None:
            figures["unit"] = self.unit
        return figures

    def stored(self) -> dict[str, Any]:
        return {**self.shown(), **self.extra}

    @classmethod
    def from_stored(cls, data: Mapping[str, Any]) -> BudgetFigures:
        fields, extra = _split(data, _FIGURES_KEYS)
        return cls(
            fields["name"],
            decimal_of(fields["limit"]),
            decimal_of(fields["spent"]),
            decimal_of(fields["amount"]),
            fields.get("unit"),
            extra,
        )


_FIGURES_KEYS = frozenset(("name", "limit", "spent", "amount", "unit"))


@dataclass(frozen=True, slots=True)
class ApprovalRecord:
    """A person's decision on an operation: asked of `deciders` when requested, decided once
    (`by` whom, `via` which channel, `reason`, `decided_at`) or expired at `expires_at`."""

    state: ApprovalState
    deciders: tuple[str, ...] = ()  # the channels that may decide ("client", "operator")
    requested_at: float | None = None
    expires_at: float | None = None
    duplicate_of: str | None = None  # a suspected duplicate waits: the earlier operation
    required_because: str | None = None  # why approval is needed when `when` could not be evaluated
    over_budget: BudgetFigures | None = None  # past its budget: what approving overspends
    # Once decided (all four are written then, `by` and `reason` possibly null).
    by: str | None = None
    via: str | None = None
    reason: str | None = None
    decided_at: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    _OPTIONAL = ("requested_at", "expires_at", "duplicate_of", "required_because", "over_budget")

    def stored(self) -> dict[str, Any]:
        data: dict[str, Any] = {"state": self.state.value, "deciders": list(self.deciders)}
        data.update(_present(self, ApprovalRecord._OPTIONAL))
        if self.over_budget is not None:
            data["over_budget"] = self.over_budget.stored()
        if self.decided_at is not None:
            data.update(by=self.by, via=self.via, reason=self.reason, decided_at=self.decided_at)
        return {**data, **self.extra}

    @classmethod
    def from_stored(cls, data: Mapping[str, Any]) -> ApprovalRecord:
        fields, extra = _split(data, _APPROVAL_KEYS)
        fields["state"] = ApprovalState(fields["state"])
        fields["deciders"] = tuple(fields.get("deciders") or ())
        if fields.get("over_budget") is not None:
            fields["over_budget"] = BudgetFigures.from_stored(fields["over_budget"])
        return cls(**fields, extra=extra)

    def decided(
        self, state: ApprovalState, by: str | None, via: str, reason: str | None, now: float
    ) -> ApprovalRecord:
        return dataclasses.replace(self, state=state, by=by, via=via, reason=reason, decided_at=now)


_APPROVAL_KEYS = frozenset(
    ("state", "deciders", *ApprovalRecord._OPTIONAL, "by", "via", "reason", "decided_at")
)
