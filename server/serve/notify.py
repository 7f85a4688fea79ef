"""Delivering the outbox: each event POSTed, signed, to the [[notify]] entry it was written for.

Runs beside the calls, never in their path: the event is already in the ledger (written with the
change that caused it), so a slow, failing or hostile receiver delays only its own deliveries. Each
event is leased while it is sent, so of several replicas one sends it at a time; it is sent again
with backoff and jitter until a 2xx or its `give_up_after`, across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, cast

import httpx2

from commitgate.server.core import approvals
from commitgate.server.ledger.base import Ledger, this_owner
from commitgate.server.ledger.evidence import Evidenced, OutboxItem, Settled
from commitgate.server.model.records import Operation, iso
from commitgate.server.policy.evidence import NotifyPolicy
from commitgate.server.policy.models import Policy
from commitgate.server.serve.evidence import target

log = logging.getLogger("commitgate.notify")

LEASE = 60.0  # seconds one sender holds an event: longer than one request may take
TIMEOUT = 10.0  # one POST, connect to last byte of the headers
POLL = 0.5  # how often the outbox is looked at when idle
BATCH = 16
_BACKOFF_FIRST, _BACKOFF_MOST = 1.0, 600.0


def backoff(attempts: int) -> float:
    """The wait before attempt `attempts + 1`: doubling from a second, at most ten minutes, jittered."""
    return min(_BACKOFF_MOST, _BACKOFF_FIRST * 2 ** max(0, attempts - 1)) * random.uniform(0.5, 1.0)


def signature(secret: str, timestamp: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def body_of(item: OutboxItem, op: Operation | None, policy: Policy, entry: NotifyPolicy) -> bytes:
    """The event as the entry's format says: the JSON event, or Slack's `{"text": ...}`."""
    operation: dict[str, Any] = {"operation_id": item.operation_id, "state": item.state}
    question: str | None = None
    if op is not None:
        operation.update(tool=op.tool, principal=op.principal, session=op.session)
        operation["arguments"] = approvals.masked(op.arguments)  # the console's masking
        if item.event == "approval_waiting":
            question = approvals.question(op, policy.tools.get(op.tool)).text
            operation["question"] = question
    console = policy.console.public_url
    link = f"{console.rstrip('/')}/operations/{item.operation_id}" if console else None
    if entry.format == "slack":
        lines = [
            f"commitgate: {item.event.replace('_', ' ')} ({operation.get('tool', '?')}, {item.operation_id})"
        ]
        if question:
            lines.append(question)
        if link:
            lines.append(f"Open in the console: {link}")
        return json.dumps({"text": "\n".join(lines)}, ensure_ascii=False).encode()
    event: dict[str, Any] = {
        "id": item.event_id,
        "event": item.event,
        "at": iso(item.at),
        "operation": operation,
    }
    if link:
        event["console_url"] = link
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()


class Deliverer:
    """Sends what is due in the outbox, a few at a time, until stopped."""

    def __init__(self, ledger: Ledger, policy: Callable[[], Policy]) -> None:
        self.ledger = cast(Evidenced, ledger)
        self._reads = ledger
        self.owner = this_owner()
        self._policy = policy  # the one served now: a reload changes secrets and URLs for the next send
        self._wake = asyncio.Event()

    @property
    def policy(self) -> Policy:
        return self._policy()

    @property
    def entries(self) -> Mapping[str, NotifyPolicy]:
        return {target(entry): entry for entry in self.policy.notify}

    async def run(self) -> None:
        """Take what is due, as many as there is room for beside the deliveries still under way: a
        receiver that hangs holds its own events only, never the others'."""
        sending: set[asyncio.Task[None]] = set()
        async with httpx2.AsyncClient(timeout=httpx2.Timeout(TIMEOUT), follow_redirects=False) as client:
            try:
                while True:
                    for item in await self._take(BATCH - len(sending)):
                        task = asyncio.create_task(self._deliver(client, item))
                        sending.add(task)
                        task.add_done_callback(sending.discard)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), POLL)
                    self._wake.clear()
            finally:
                for task in sending:
                    task.cancel()
                await asyncio.gather(*sending, return_exceptions=True)

    async def _take(self, room: int) -> list[OutboxItem]:
        if room <= 0:
            return []
        try:
            return await self.ledger.outbox_take(self.owner, time.time(), LEASE, room)
        except Exception as exc:  # the ledger is away: the events wait in it
            log.warning("notifications: cannot read the outbox (%s); trying again", exc)
            return []

    async def _deliver(self, client: httpx2.AsyncClient, item: OutboxItem) -> None:
        entry = self.entries.get(item.target)
        now = time.time()
        if entry is None:
            outcome = Settled(now, failed_at=now, error="no [[notify]] entry for it any more")
        else:
            error = await self._post(client, item, entry)
            outcome = self._after(item, entry, error, time.time())
        try:
            await self.ledger.outbox_settle(item, self.owner, outcome)
        except Exception as exc:  # its lease runs out and it is sent again: at least once
            log.warning("notifications: cannot record delivery of %s (%s)", item.event_id, exc)
        self._wake.set()  # room for another

    async def _post(self, client: httpx2.AsyncClient, item: OutboxItem, entry: NotifyPolicy) -> str | None:
        """None when the receiver took it (2xx); else what went wrong."""
        try:
            op = await self._reads.get_by_id(None, item.operation_id)
            body = body_of(item, op, self.policy, entry)
            stamp = str(int(time.time()))
            headers = {
                "Content-Type": "application/json",
                "Commitgate-Event-Id": item.event_id,
                "Commitgate-Timestamp": stamp,
                "Commitgate-Signature": signature(entry.secret, stamp, body),
            }
            async with (
                asyncio.timeout(TIMEOUT),
                client.stream("POST", entry.url, content=body, headers=headers) as answer,
            ):
                status = answer.status_code  # the body is never read: its size cannot matter
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        return None if 200 <= status < 300 else f"HTTP {status}"

    @staticmethod
    def _after(item: OutboxItem, entry: NotifyPolicy, error: str | None, now: float) -> Settled:
        if error is None:
            return Settled(now, delivered_at=now)
        if now - item.at >= entry.give_up_after:
            log.warning("notifications: gave up on %s (%s) after %d attempts: %s", item.event_id, item.event,
                        item.attempts + 1, error)  # fmt: skip
            return Settled(now, failed_at=now, error=error)
        return Settled(now + backoff(item.attempts + 1), error=error)


@contextlib.asynccontextmanager
async def delivering(ledger: Ledger, policy: Callable[[], Policy]) -> AsyncIterator[Deliverer | None]:
    """Deliveries beside serving, when the policy has [[notify]] entries and the ledger an outbox."""
    if not policy().notify or not hasattr(ledger, "outbox_take"):
        yield None
        return
    deliverer = Deliverer(ledger, policy)
    task = asyncio.create_task(deliverer.run(), name="commitgate-notify")
    try:
        yield deliverer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
