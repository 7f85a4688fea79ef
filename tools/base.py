"""The one interface every tool source implements (python, http, upstream)."""

from __future__ import annotations

from typing import Any, Protocol

from commitgate.server.model.context import OperationContext
from commitgate.server.model.records import ToolResult
from commitgate.server.policy.models import Problem


class InvalidArguments(Exception):
    """Arguments do not match the tool's schema; the message names the field."""


class ToolBuildError(Exception):
    """A policy entry whose source cannot be built; each problem names its place in the policy."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


class ToolSource(Protocol):
    """Where a tool's work is done. Arguments are the normalised JSON object, without the key."""

    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None
    has_status_check: bool

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check `arguments` and return their normalised JSON form; raise InvalidArguments."""
        ...

    async def call(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult:
        """Run once. Raise RetryableError, AmbiguousError or PermanentError to say what happened."""
        ...

    async def status(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        """Ask the system of record: the result if the action took effect, None if it certainly
        did not; raise if it cannot tell."""
        ...

    async def aclose(self) -> None: ...
