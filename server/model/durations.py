"""Durations as people write them in a policy: "250ms", "10s", "5m", "24h", "7d"."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
DURATION_PATTERN = r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$"  # also the JSON schema's
_PATTERN = re.compile(DURATION_PATTERN)


def parse_duration(value: object) -> float:
    """Seconds as a float; bare numbers are seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration is a string like '250ms', '10s', '5m', '24h' or '7d'")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match:
            return float(match.group(1)) * _UNITS[match.group(2)]
    raise ValueError(f"invalid duration {value!r}: write it like '250ms', '10s', '5m', '24h' or '7d'")


def format_duration(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{round(seconds * 1000)}ms" if seconds < 1 else f"{seconds:g}s"
