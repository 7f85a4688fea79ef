"""Around every `tools/call`, on every transport: a limit per principal, and the call told to its observers.

Both wrap the handler the MCP surface registers (surface.py) and read the call's envelope
(`Call`), resolved once. The limit answers the call that would exceed
`limits.max_concurrent_per_principal` with `retries_exhausted`, nothing executed; meta tools
are not limited, so polling stays possible while work runs. Whatever the end of a call (a reply,
a protocol error, a cancellation), the gateway's call observers (logs, metrics, the call's span)
are told once, from what the reply says where it was made.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import mcp.types as types

from commitgate.server.core.errors import GateError
from commitgate.server.model.events import CANCELLED, PROTOCOL_ERROR, CallAnswered
from commitgate.server.model.facts import ErrorCode
from commitgate.server.serve.envelope import Call, Reply, ReplyTo
from commitgate.server.serve.gateway import Gateway, refused

Answered = types.CallToolResult | types.InputRequiredResult
Handler = Callable[[Call], Awaitable[Answered]]  # a tools/call chain as the MCP surface serves it


def observed(handler: ReplyTo, gateway: Gateway) -> Handler:
    """`handler`'s answers, each call told to `gateway.answered` once, whatever its end."""

    async def observe(call: Call) -> Answered:
        reply: Reply | None = None
        code = PROTOCOL_ERROR  # what an exception other than a cancellation becomes (a JSON-RPC error)
        start = time.perf_counter()
        gateway.answering += 1
        try:
            reply = await handler(call)
            return reply.result
        except asyncio.CancelledError:
            code = CANCELLED
            raise
        finally:
            seconds = time.perf_counter() - start
            gateway.answering -= 1
            tool, cls = call.labels
            if reply is None:
                event = CallAnswered(tool, cls, call.principal, code, seconds, arguments=call.arguments)
            else:
                _, said, operation, replayed, message = reply
                event = CallAnswered(
                    tool, cls, call.principal, said, seconds, operation, replayed, message, call.arguments
                )
            gateway.answered(event)

    return observe


def limited(handler: ReplyTo) -> ReplyTo:
    """`handler` with at most `limits.max_concurrent_per_principal` calls of one principal at once.

    One event loop serves all requests, so a plain dict needs no lock.
    """
    active: dict[str, int] = {}

    async def limit(call: Call) -> Reply:
        if not call.limited:
            return await handler(call)
        principal = call.principal
        most = call.generation.policy.server.limits.max_concurrent_per_principal
        running = active.get(principal, 0)
        if running >= most:
            return over_limit(most)
        active[principal] = running + 1
        try:
            return await handler(call)
        finally:
            left = active[principal] - 1
            if left:
                active[principal] = left
            else:
                del active[principal]

    return limit


def over_limit(limit: int) -> Reply:
    message = (
        f"Too many calls at once: {limit} of your calls are already running (limits.max_concurrent_per_principal). "
        "Nothing was executed or recorded. Wait for one to finish, then call again with the same "
        "idempotency_key; poll get_operation_status for the ones in progress."
    )
    # No code of its own for this: like retries_exhausted it is transient and certainly not
    # applied, so clients that already handle that code do the right thing.
    return refused(GateError(ErrorCode.RETRIES_EXHAUSTED, message), replayed=False)
