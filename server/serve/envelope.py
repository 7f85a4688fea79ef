"""One tools/call as every layer below the MCP surface sees it, and the reply it gets.

`Generation` is what calls are served from (swapped whole on a reload), `Call` the request
resolved once at the surface, `Reply` an answer together with what it says (its code, its
operation, its message), told by whoever made it so that nobody reads a rendered answer back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import mcp.types as types

from commitgate.server.core.requests import RunSettings
from commitgate.server.model.events import OK
from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.model.records import Operation
from commitgate.server.policy.models import Policy
from commitgate.server.serve.asking import ClientChannel
from commitgate.server.serve.meta_tools import META_TOOLS
from commitgate.server.serve.registry import ServedTool

UNKNOWN_TOOL = "(unknown)"  # how metrics and logs name a tool the policy does not serve


@dataclass(frozen=True, slots=True)
class Generation:
    """What new calls are served from: one policy and its tools, built once and swapped whole on a
    reload (a call keeps the generation it started with)."""

    policy: Policy
    served: Mapping[str, ServedTool]
    meta: frozenset[str]  # the meta tools offered beside them
    listed: tuple[types.Tool, ...]  # what tools/list answers
    labels: Mapping[str, tuple[str, str]]  # (tool, class) of each name a call may give, for Call.labels
    settings: RunSettings  # what each call keeps until its outcome is recorded

    @classmethod
    def of(cls, policy: Policy, served: Mapping[str, ServedTool]) -> Generation:
        # compensate_session only where something can be compensated: a model should not try it in vain.
        compensable = any(
            s.guard.policy.idempotency_class is IdempotencyClass.COMPENSABLE for s in served.values()
        )
        meta = [name for name in META_TOOLS if compensable or name != "compensate_session"]
        exposed = [s.definition for s in served.values() if s.exposed]
        labels = {name: (name, s.guard.idempotency_class.value) for name, s in served.items() if s.exposed}
        labels.update((name, (name, "meta")) for name in META_TOOLS)
        listed = (*exposed, *(META_TOOLS[name] for name in meta))
        return cls(policy, served, frozenset(meta), listed, labels, RunSettings.of(policy.server))

    def offers(self, name: str) -> bool:
        served = self.served.get(name)
        return name in self.meta or (served is not None and served.exposed)


@dataclass(frozen=True, slots=True)
class Call:
    """One tools/call, resolved once at the MCP surface: every layer below reads it from here."""

    name: str
    arguments: Mapping[str, Any] | None
    meta: Mapping[str, Any]
    principal: str
    generation: Generation  # the whole call is served from the tools it started with
    channel: ClientChannel | None = None  # how to ask the client's user for an approval

    @property
    def labels(self) -> tuple[str, str]:
        """(tool, class) as metrics and logs name them: unknown and hidden tools alike are "(unknown)"."""
        return self.generation.labels.get(self.name, _UNKNOWN_LABELS)

    @property
    def limited(self) -> bool:
        """Counted against `limits.max_concurrent_per_principal`: meta tools are not, so polling stays
        possible while work runs."""
        return self.name not in META_TOOLS


_UNKNOWN_LABELS = (UNKNOWN_TOOL, "none")


class Reply(NamedTuple):
    """An answer and what it says, from where it was made: logs, metrics and the call's span learn
    the code, the operation and the message from here, never from the rendered result."""

    result: types.CallToolResult | types.InputRequiredResult
    code: str = OK  # see `CallAnswered.code`
    operation: Operation | None = None
    replayed: bool = False
    message: str | None = None  # an error's message (it may quote arguments)


ReplyTo = Callable[[Call], Awaitable[Reply]]
