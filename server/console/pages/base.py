"""What a page module declares, and what its handlers share: the ledger and who may see what."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from starlette.requests import Request
from starlette.routing import BaseRoute

from commitgate.server.console.security import Identity
from commitgate.server.core import expiry
from commitgate.server.ledger import OperationFilter
from commitgate.server.ledger.base import Ledger
from commitgate.server.model.records import Operation
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


def sole_principal(request: Request) -> str | None:
    """The one principal this person sees, when it sees exactly one (the pages then hide the column)."""
    seen = identity_of(request).principals
    return next(iter(seen)) if seen is not None and len(seen) == 1 else None


async def visible(request: Request, operation_id: str) -> Operation | None:
    """The operation, if this person may see it: another principal's is as absent as a purged one."""
    op = await ledger_of(request).get_by_id(None, operation_id)
    return op if op is not None and identity_of(request).sees(op.principal) else None


async def find_visible(request: Request, where: OperationFilter) -> list[Operation]:
    """`where` over the operations this person sees (its principal field is replaced), newest first."""
    ledger, seen = ledger_of(request), identity_of(request).principals
    if seen is None:
        return await ledger.find(where)
    if where.principal is not None:
        return await ledger.find(where) if where.principal in seen else []
    found = [op for p in sorted(seen) for op in await ledger.find(replace(where, principal=p))]
    found.sort(key=lambda op: op.created_at, reverse=True)
    return found[: where.limit]


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
    await expiry.sweep(ledger, at, look_first=True)
