"""Quantiles and spreads: how the bench sums up samples and rounds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: list[float], digits: int = 3) -> dict[str, float]:
    """Median with the interquartile range and the extremes: how much a figure moved between rounds."""
    return {
        "median": round(statistics.median(values), digits),
        "p25": round(quantile(values, 0.25), digits),
        "p75": round(quantile(values, 0.75), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }
