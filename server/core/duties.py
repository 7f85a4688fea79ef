"""What the commit boundary does beside the calls while serving.

Renew the leases of the operations it runs; sweep: turn operations whose owner's lease ran out
`UNKNOWN` (an owner that died) and expire waits for approval past their timeout; purge records
past their retention. On the way out, the work in flight gets a moment to record its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from commitgate.server.core import expiry
from commitgate.server.ledger.base import Lease, LedgerUnavailable

if TYPE_CHECKING:
    from commitgate.server.core.boundary import CommitBoundary

log = logging.getLogger("commitgate.boundary")


@contextlib.asynccontextmanager
async def running(
    boundary: CommitBoundary, *, sweep_every: float | None = None, purge_every: float = 60.0
) -> AsyncIterator[None]:
    with contextlib.suppress(LedgerUnavailable):
        await boundary.ledger.expire_leases(boundary.clock())
    lease = boundary.settings.lease
    loops = [
        asyncio.create_task(_every(lease / 3, "lease renewal", lambda: _renew_leases(boundary))),
        asyncio.create_task(_every(sweep_every or lease / 2, "sweep", lambda: _sweep(boundary))),
        asyncio.create_task(_every(purge_every, "purge", lambda: boundary.ledger.purge(boundary.clock()))),
    ]
    try:
        yield
    finally:
        await boundary.drain()
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


async def _every(period: float, name: str, duty: Callable[[], Awaitable[object]]) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            await duty()
        except Exception:  # a failing duty must not stop the others; it is logged and retried
            log.exception("background duty %s failed", name)


async def _renew_leases(boundary: CommitBoundary) -> None:
    for operation_id, fence in list(boundary.leases.items()):
        lease = Lease(boundary.owner, boundary.clock() + boundary.settings.lease)
        await boundary.ledger.renew_lease(operation_id, fence, lease)


async def _sweep(boundary: CommitBoundary) -> None:
    await expiry.sweep(boundary.ledger, boundary.clock(), boundary.tell)
