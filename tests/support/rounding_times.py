"""Times that test a formatter's rounding: given edges, thousands of random times, a walk across two
seconds in odd steps, and each step's float just below it (where rounding to the unit flips)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def rounding_times(edges: tuple[float, ...], seed: int) -> Iterator[float]:
    rng = random.Random(seed)
    spread = [rng.uniform(1.6e9, 2.0e9) for _ in range(20_000)]
    steps = [1_764_604_800 + micros / 1e6 for micros in range(0, 2_000_000, 997)]
    yield from (*edges, *spread, *steps, *(math.nextafter(t, 0) for t in steps))
