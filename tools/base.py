"""The one interface every tool source implements (python, http, upstream)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from commitgate.server.model.context import OperationContext
from commitgate.server.model.records import ToolResult
from commitgate.server.policy.models import Policy, ToolPolicy
from commitgate.server.policy.problems import Problem

if TYPE_CHECKING:  # only the http source uses a client: the others, and `policy check`, never import it
    import httpx2


class InvalidArguments(Exception):
    """Arguments do not match the tool's schema; the message names the field."""


class ToolBuildError(Exception):
    """A policy entry whose source cannot be built; each problem names its place in the policy."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Collaborators:
    """What sources borrow from the server that serves them. The gateway creates and closes each;
    a source never closes what it was given. Without them (e.g. `policy check`) sources are built
    to be checked, not called."""

    http: httpx2.AsyncClient | None = None  # the server's pooled client, for http sources
    upstream: Callable[[str], Any] = field(default=lambda name: None)  # upstream name -> its connection


class ToolSource(Protocol):
    """Where a tool's work is done. Arguments are the normalised JSON object, without the key.

    Every source is built the same way, `Source(name, policy, whole_policy, collaborators)`, and
    raises DeclarationError for what it finds wrong in its entry."""

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


class SourceLoadError(Exception):
    """A `module:function` reference that cannot be imported or used.

    `field` names the policy key it came from when that is not the tool's own source (e.g.
    `status_check`), so the problem is reported on the line that holds the reference.
    """

    field: str | None = None


class DeclarationError(SourceLoadError):
    """A policy entry the source cannot serve, with its place in the policy file (`tools.X.http.url`)."""

    def __init__(self, location: str, message: str) -> None:
        super().__init__(f"{location}: {message}")
        self.location, self.message = location, message


# Which class serves each kind of source; imported when a policy uses it (start-up time matters).
_SOURCES = {
    "python": ("commitgate.tools.python", "PythonTool"),
    "http": ("commitgate.tools.http", "HttpTool"),
    "upstream": ("commitgate.tools.upstream", "UpstreamTool"),
}


def build_source(name: str, policy: ToolPolicy, whole: Policy, using: Collaborators) -> ToolSource:
    """The source of one policy entry, chosen by the kind of source it declares."""
    module, cls = _SOURCES[policy.source_kind]
    source: ToolSource = getattr(importlib.import_module(module), cls)(name, policy, whole, using)
    return source
