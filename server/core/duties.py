"""What the commit boundary does beside the calls while serving.

Renew the leases of the operations this process runs (each by the lease its call was claimed
under); sweep: turn operations whose owner's lease ran out `UNKNOWN` (an owner that died) and
expire waits for approval past their timeout; purge records past their retention. On the way out, the work in flight gets a moment to record its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from commitgate.server.core import expiry
from commitgate.server.core.ground import Site
from commitgate.server.core.runs import Runs
from commitgate.server.ledger.base import Lease, LedgerUnavailable

log = logging.getLogger("commitgate.boundary")


@contextlib.asynccontextmanager
async def running(
    runs: Runs, lease: float, *, sweep_every: float | None = None, purge_every: float = 60.0
) -> AsyncIterator[None]:
    """`lease`: the one of the policy served at the start, which paces the renewals and the sweep."""
    site = runs.site
    with contextlib.suppress(LedgerUnavailable):
        await site.ledger.expire_leases(site.clock())
    loops = [
        asyncio.create_task(_every(lease / 3, "lease renewal", lambda: _renew_leases(runs))),
        asyncio.create_task(_every(sweep_every or lease / 2, "sweep", lambda: _sweep(site))),
        asyncio.create_task(_every(purge_every, "purge", lambda: site.ledger.purge(site.clock()))),
    ]
    try:
        yield
    finally:
        await runs.drain()
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


async def _renew_leases(runs: Runs) -> None:
    site = runs.site
    for operation_id, (fence, seconds) in list(runs.leases.items()):
        await site.ledger.renew_lease(operation_id, fence, Lease(site.owner, site.clock() + seconds))


async def _sweep(site: Site) -> None:
    await expiry.sweep(site.ledger, site.clock(), site.tell)
