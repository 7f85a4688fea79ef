"""A python tool that counts how often its argument is validated and changes what it is given.

`pack(items, boxes)` records the items it received in `RECEIVED`, then empties the list it was given
(a tool may change its arguments); the first `FAIL_FIRST[0]` calls then fail retryably.
"""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from commitgate.server.model.outcomes import RetryableError

VALIDATIONS = [0]
RECEIVED: list[list[str]] = []
FAIL_FIRST = [0]


def _counted(items: list[str]) -> list[str]:
    VALIDATIONS[0] += 1
    return items


async def pack(
    items: Annotated[list[str], AfterValidator(_counted)], boxes: Annotated[int, Field(gt=0)] = 1
) -> dict[str, Any]:
    """Pack the items."""
    RECEIVED.append(list(items))
    items.clear()
    if FAIL_FIRST[0] > 0:
        FAIL_FIRST[0] -= 1
        raise RetryableError("not yet")
    return {"packed": len(RECEIVED[-1])}


async def typed(
    when: datetime.datetime, amount: decimal.Decimal, id: uuid.UUID, tags: tuple[str, ...]
) -> None:
    """Values that JSON writes differently from how Python holds them."""
