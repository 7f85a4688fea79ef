"""What a page module declares, and what its handlers share: the ledger and who may see what."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.routing import BaseRoute

from commitgate.server.console.security import Identity
from commitgate.server.core import approvals
from commitgate.server.ledger import OperationFilter
from commitgate.server.ledger.base import Ledger, lease_over
from commitgate.server.model.facts import State
from commitgate.server.policy.models import Policy


@dataclass(frozen=True, slots=True)
class Page:
    """One entry of the navigation (`label` links to `path`) and the routes that serve it."""

    label: str
    path: str
    routes: Sequence[BaseRoute]


def ledger_of(request: Request) -> Ledger:
    ledger: Ledger = request.app.state.ledger
    return ledger


def identity_of(request: Request) -> Identity:
    identity: Identity = request.state.identity
    return identity


def scope_of(request: Request) -> str | None:
    """The principal whose operations this person sees; None: every principal (the console's own token)."""
    return identity_of(request).principal


def policy_of(request: Request) -> Policy | None:
    """The policy the console was started with: the tools' approval prompts (None: none known)."""
    policy: Policy | None = request.app.state.policy
    return policy


def now() -> float:
    return time.time()


async def touch(ledger: Ledger, at: float) -> None:
    """A listing is a touch (docs/contract.md#leases): a RUNNING operation whose owner is gone shows as
    UNKNOWN, and a wait for approval that ran out shows as expired (FAILED_FINAL, approval_expired), as
    the server's sweep would make them. Only read, unless there is one to turn."""
    running = await ledger.find(OperationFilter(None, state=State.RUNNING, limit=1000))
    if any(lease_over(op, at) for op in running):
        await ledger.expire_leases(at)
    await approvals.expire_due(ledger, at)
