"""Budget amounts: exact decimals with up to 9 places, never binary floats.

Three calls of 0.1 fit a limit of 0.3 only if nothing on the way adds in binary. A number read
from a policy, from a call's arguments or from a CEL expression is taken as the decimal it is
written as (a float as its shortest repr: 0.1 is 0.1), rounded to 9 places, and added as a
`Decimal`. The SQLite ledger stores one as whole units plus billionths (two integers that add up
exactly); PostgreSQL as `numeric` (docs/policy.md#budgets).
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Any

PLACES = 9
_QUANTUM = Decimal(1).scaleb(-PLACES)
BILLION = 10**PLACES
# The most one amount or limit may be: sums of whole units stay within a 64-bit integer.
MAXIMUM = Decimal(10) ** 15
ZERO = Decimal(0)


class NotAnAmount(ValueError):
    """A value that is not a finite number within the range a budget adds up exactly."""


def amount(value: Any) -> Decimal:
    """`value` (int, float, Decimal or numeric text) as an exact amount rounded to 9 places."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal | str):
        raise NotAnAmount(f"not a number: {value!r}")
    try:
        exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    except InvalidOperation:
        raise NotAnAmount(f"not a number: {value!r}") from None
    if not exact.is_finite():
        raise NotAnAmount("must be a finite number")
    if abs(exact) > MAXIMUM:
        raise NotAnAmount(f"must be at most {text(MAXIMUM)}")
    return exact.quantize(_QUANTUM, ROUND_HALF_EVEN)


def decimal_of(value: Decimal | int | float) -> Decimal:
    """A figure to show (a sum may pass what one amount may be): exact, without the input checks."""
    return (
        value if isinstance(value, Decimal) else Decimal(repr(value) if isinstance(value, float) else value)
    )


def split(value: Decimal) -> tuple[int, int]:
    """(whole units, billionths) of an amount >= 0: what the SQLite ledger stores."""
    nanos = int(value.scaleb(PLACES))
    return divmod(nanos, BILLION)


def joined(units: int | None, nanos: int | None) -> Decimal:
    """The amount (or sum of amounts) stored as whole units and billionths."""
    return Decimal(units or 0) + Decimal(nanos or 0).scaleb(-PLACES)


def text(value: Decimal) -> str:
    """An amount as people read it: no exponent, no trailing zeros ("0", "1000", "0.1")."""
    shown = f"{value.normalize():f}"
    return "0" if shown in ("-0", "0") else shown


def with_unit(value: Decimal, unit: str | None) -> str:
    """An amount followed by its budget's unit, when the budget has one ("1000 USD cents")."""
    return f"{text(value)} {unit}" if unit else text(value)


def grouped(value: Decimal | int | float, unit: str | None = None) -> str:
    """An amount for a page: thousands separated, every decimal kept ("1,234.5 USD cents")."""
    shown = f"{decimal_of(value).normalize():,f}"
    shown = "0" if shown in ("-0", "0") else shown
    return f"{shown} {unit}" if unit else shown


def number(value: Decimal | int | float) -> int | float:
    """An amount as a JSON number: an integer when whole, else the decimal's shortest float."""
    value = decimal_of(value)
    if value == value.to_integral_value():
        return int(value)
    return float(text(value))


def left(limit: Decimal, spent: Decimal) -> Decimal:
    """What a budget still allows (never below zero)."""
    return max(ZERO, limit - spent)
