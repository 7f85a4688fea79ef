"""Durations as people write them in a policy: "250ms", "10s", "5m", "24h", "7d".

One form only, a number and its unit with nothing between: a bare `10` could mean seconds or
milliseconds, and `"10 s"` is not what the documentation shows. Ten years is the longest
duration taken, so no timer or timestamp computed from one can overflow.
"""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
DURATION_PATTERN = r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$"  # also the JSON schema's
_PATTERN = re.compile(DURATION_PATTERN)
MAX_DURATION = 3650 * 86400.0
FORM = "write it like '250ms', '10s', '5m', '24h' or '7d'"


def parse_duration(value: object) -> float:
    """Seconds as a float, from the written form; numbers (seconds) only from Python callers."""
    if isinstance(value, bool):
        raise ValueError(f"a duration is a string: {FORM}")
    if isinstance(value, int | float):
        seconds = float(value)
        if seconds < 0:
            raise ValueError("a duration cannot be negative")
    elif isinstance(value, str) and (match := _PATTERN.fullmatch(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ValueError(f"invalid duration {value!r}: {FORM}")
    if seconds > MAX_DURATION:
        raise ValueError(f"duration {value!r} is too long: at most '3650d' (ten years)")
    return seconds


def parse_written_duration(value: object) -> float:
    """A duration as written in a file or on a command line: a string with its unit, never a bare number."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(
            f"a duration is a string with its unit, e.g. '{value}s' rather than {value!r}: {FORM}"
        )
    return parse_duration(value)


def format_duration(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{round(seconds * 1000)}ms" if seconds < 1 else f"{seconds:g}s"
