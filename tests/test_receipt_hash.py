"""The hash a writer gives a receipt is the one a verifier computes: the canonical JSON of its
fields, however the writer builds it, for any text a field may hold."""

from __future__ import annotations

import random
from typing import Any

from commitgate.server.model.receipts import SIGNED, canonical, chained_hash, receipt_hash

# What JSON escapes or keeps: quotes, backslashes, control characters, non-ASCII (BMP and beyond),
# the line separators JavaScript treats as newlines, and the characters some encoders escape.
TRICKY = [
    '"',
    "\\",
    "\n",
    "\t",
    "\x00",
    "\x1f",
    "\x7f",
    "é",
    "中",
    "😀",
    "\u2028",
    "\u2029",
    "/",
    "<",
    "&",
    "a",
]


def text(rng: random.Random) -> str | None:
    if rng.random() < 0.15:
        return None
    return "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 10)))


def test_a_writers_hash_is_the_canonical_one_for_any_field_text() -> None:
    rng = random.Random(20261203)
    for n in range(5000):
        values: list[Any] = [rng.randint(1, 2**53), *(text(rng) for _ in SIGNED[1:])]
        if n % 50 == 0:  # a field that is not text (a number, a bool): encoded as JSON encodes it
            values[rng.randrange(len(values))] = rng.choice([7, 2.5, True, False])
        fields: dict[str, Any] = dict(zip(SIGNED, values, strict=True))
        assert chained_hash(*values) == receipt_hash(fields), canonical(fields)
