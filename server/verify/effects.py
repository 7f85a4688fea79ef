"""How `commitgate verify` counts a tool's effects, strongest evidence first.

1. a count function of the user's (`--count module:function`): key -> how many effects
   the system of record holds for that key; exact.
2. the tool's status check: found / not found under the key; it cannot tell one effect
   from two, so the tool's invocation count is checked alongside.
3. the boundary's own count of the tool's invocations; the effect itself is not seen.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from commitgate.server.model.context import OperationContext


class CouldNotRun(Exception):
    """verify could not run its tests; the message is the one-line reason."""


class CountedBy(StrEnum):
    COUNT_FUNCTION = "count function"
    STATUS_CHECK = "status check"
    INVOCATIONS = "invocations"

    def explain(self, where: str) -> str:
        if self is CountedBy.COUNT_FUNCTION:
            return f"effects counted in the system of record by {where}"
        if self is CountedBy.STATUS_CHECK:
            return "effects seen through the tool's status check (found / not found) and its invocation count"
        return "the boundary's invocation count only: the effects themselves were not observed (pass --count)"


@dataclass(frozen=True)
class Evidence:
    """What one test saw: effects (None when not countable), the status check's word, tool runs."""

    effects: int | None
    found: bool | None
    invocations: int

    def exactly_one(self) -> bool:
        if self.effects is not None:
            return self.effects == 1
        if self.found is not None:
            return self.found and self.invocations == 1
        return self.invocations == 1

    def describe(self) -> str:
        if self.effects is not None:
            return str(self.effects)
        if self.found is not None:
            return "found" if self.found else "not found"
        return "-"


def load_count_function(spec: str, search: list[Path]) -> Callable[[str], Any]:
    """Import `module:function`; the current directory and the policy's are searched first."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise CouldNotRun(f"--count {spec!r}: expected module:function, e.g. mytools.counts:charges_for_key")
    for folder in search:
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise CouldNotRun(f"--count {spec!r}: cannot import {module_name}: {exc}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise CouldNotRun(f"--count {spec!r}: {module_name} has no function {attribute}")
    return function


async def count_with(function: Callable[[str], Any], spec: str, key: str) -> int:
    """Call the count function for `key` (sync or async) and insist on a non-negative integer."""
    try:
        value = function(key)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:
        raise CouldNotRun(f"--count {spec!r} failed for key {key!r}: {exc or type(exc).__name__}") from None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CouldNotRun(
            f"--count {spec!r} returned {value!r} ({type(value).__name__}), not a number of effects (an int >= 0)"
        )
    return value


def context_for(
    key: str, session: str, principal: str, tool: str, operation_id: str | None = None
) -> OperationContext:
    """The context a tool or status check sees for `key`, as the boundary would build it."""
    return OperationContext(key, session, operation_id or f"verify-{key}", 1, principal, tool)
