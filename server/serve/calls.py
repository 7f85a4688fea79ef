"""Around every `tools/call`, on every transport: a limit per principal, a log line, a metrics sample.

Both wrap the handler the MCP surface registers (surface.py) and read the call's envelope
(`Call`), resolved once. The limit answers the call that would exceed
`limits.max_concurrent_per_principal` with `retries_exhausted`, nothing executed; meta tools
are not limited, so polling stays possible while work runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import mcp.types as types

from commitgate.server.core.errors import GateError
from commitgate.server.model.facts import OPERATION_META, ErrorCode
from commitgate.server.serve.gateway import Call, render_error
from commitgate.server.serve.logs import log_call, unredacted
from commitgate.server.serve.metrics import Metrics

Answered = types.CallToolResult | types.InputRequiredResult
Handler = Callable[[Call], Awaitable[Answered]]


def _outcome(result: Answered) -> tuple[str, dict[str, Any] | None, str | None]:
    """(answer code, operation meta, error message) of a tools/call answer, without copying its content."""
    if isinstance(result, types.InputRequiredResult):  # a first round: the client will call again
        return "input_required", None, None
    meta, structured = result.meta, result.structured_content
    operation = meta.get(OPERATION_META) if isinstance(meta, dict) else None
    if not result.is_error:
        return "ok", operation, None
    error = structured.get("error") if isinstance(structured, dict) else None
    if not isinstance(error, dict):  # a tool's own error shape (or the fault plan's): said as it is
        return "error", operation, None if error is None else str(error)
    return str(error.get("code") or "error"), operation, error.get("message")


def recorded(handler: Handler, metrics: Metrics | None) -> Handler:
    """`handler` with one log line and (when served) one metrics sample per call, whatever its end."""

    async def record(call: Call) -> Answered:
        tool, cls = call.labels
        code, operation, message = "protocol_error", None, None
        start = time.perf_counter()
        if metrics is not None:
            metrics.in_progress.inc()
        try:
            result = await handler(call)
            code, operation, message = _outcome(result)
            return result
        except asyncio.CancelledError:
            code = "cancelled"
            raise
        finally:
            seconds = time.perf_counter() - start
            if metrics is not None:
                metrics.in_progress.dec()
                metrics.call_finished(tool, cls, code, seconds)
            arguments = call.arguments if unredacted() else None
            log_call(tool, cls, call.principal, code, seconds, operation, message, arguments)

    return record


def limited(handler: Handler) -> Handler:
    """`handler` with at most `limits.max_concurrent_per_principal` calls of one principal at once.

    One event loop serves all requests, so a plain dict needs no lock.
    """
    active: dict[str, int] = {}

    async def limit(call: Call) -> Answered:
        if not call.limited:
            return await handler(call)
        principal = call.principal
        most = call.generation.policy.server.limits.max_concurrent_per_principal
        running = active.get(principal, 0)
        if running >= most:
            return limit_error(most)
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


def limit_error(limit: int) -> types.CallToolResult:
    message = (
        f"Too many calls at once: {limit} of your calls are already running (limits.max_concurrent_per_principal). "
        "Nothing was executed or recorded. Wait for one to finish, then call again with the same "
        "idempotency_key; poll get_operation_status for the ones in progress."
    )
    # No code of its own for this: like retries_exhausted it is transient and certainly not
    # applied, so clients that already handle that code do the right thing.
    return render_error(GateError(ErrorCode.RETRIES_EXHAUSTED, message), replayed=False)
