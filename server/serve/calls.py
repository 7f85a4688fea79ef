"""Around every `tools/call`, on every transport: a limit per principal, a log line, a metrics sample.

Both are SDK middleware installed by the MCP surface (surface.py). The limit answers the call
that would exceed `limits.max_concurrent_per_principal` with `retries_exhausted`, nothing
executed; meta tools are not limited, so polling stays possible while work runs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import mcp.types as types
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext

from commitgate.server.core.errors import GateError
from commitgate.server.model.facts import OPERATION_META, ErrorCode
from commitgate.server.serve.auth import principal_of_request
from commitgate.server.serve.gateway import META_TOOLS, Gateway, render_error
from commitgate.server.serve.logs import log_call, unredacted
from commitgate.server.serve.metrics import UNKNOWN_TOOL, Metrics


def _tool_name(ctx: ServerRequestContext[Any, Any]) -> str | None:
    name = ctx.params.get("name") if ctx.params else None
    return name if isinstance(name, str) else None


def _principal(gateway: Gateway) -> str:
    return principal_of_request() or gateway.default_principal


def _labels(gateway: Gateway, name: str | None) -> tuple[str, str]:
    if name is not None and name in META_TOOLS:
        return name, "meta"
    served = gateway.served.get(name) if name else None
    if served is None or not served.exposed:
        return UNKNOWN_TOOL, "none"
    return name or UNKNOWN_TOOL, served.guard.idempotency_class.value


def _outcome(result: HandlerResult) -> tuple[str, dict[str, Any] | None, str | None]:
    """(answer code, operation meta, error message) of a tools/call answer, without copying its content."""
    if isinstance(result, types.InputRequiredResult) or (
        isinstance(result, dict) and result.get("resultType") == "input_required"
    ):  # a first round: the client is asked (an approval) and will call again
        return "input_required", None, None
    if isinstance(result, types.CallToolResult):
        parts: tuple[Any, Any, Any] = (result.is_error, result.meta, result.structured_content)
    elif isinstance(result, dict):
        parts = (result.get("isError"), result.get("_meta"), result.get("structuredContent"))
    else:
        return "ok", None, None
    is_error, meta, structured = parts
    operation = meta.get(OPERATION_META) if isinstance(meta, dict) else None
    if not is_error:
        return "ok", operation, None
    error = (structured or {}).get("error") if isinstance(structured, dict) else None
    if not isinstance(error, dict):  # a tool's own error shape (or the fault plan's): said as it is
        return "error", operation, None if error is None else str(error)
    return str(error.get("code") or "error"), operation, error.get("message")


class CallRecorder:
    """SDK middleware: one log line and (when served) one metrics sample per tools/call, whatever its end."""

    def __init__(self, gateway: Gateway, metrics: Metrics | None) -> None:
        self.gateway, self.metrics = gateway, metrics

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        if ctx.method != "tools/call":
            return await call_next(ctx)
        tool, cls = _labels(self.gateway, _tool_name(ctx))
        code, operation, message = "protocol_error", None, None
        start = time.perf_counter()
        if self.metrics is not None:
            self.metrics.in_progress.inc()
        try:
            result = await call_next(ctx)
            code, operation, message = _outcome(result)
            return result
        except asyncio.CancelledError:
            code = "cancelled"
            raise
        finally:
            seconds = time.perf_counter() - start
            if self.metrics is not None:
                self.metrics.in_progress.dec()
                self.metrics.call_finished(tool, cls, code, seconds)
            arguments = (ctx.params or {}).get("arguments") if unredacted() else None
            log_call(tool, cls, _principal(self.gateway), code, seconds, operation, message, arguments)


class PrincipalLimit:
    """SDK middleware: at most `limits.max_concurrent_per_principal` tool calls of one principal at once.

    Meta tools are not limited: polling must stay possible while work runs.
    One event loop serves all requests, so a plain dict needs no lock.
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.active: dict[str, int] = {}

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        name = _tool_name(ctx)
        if ctx.method != "tools/call" or name is None or name in META_TOOLS:
            return await call_next(ctx)
        principal = _principal(self.gateway)
        limit = self.gateway.policy.server.limits.max_concurrent_per_principal
        running = self.active.get(principal, 0)
        if running >= limit:
            return limit_error(limit)
        self.active[principal] = running + 1
        try:
            return await call_next(ctx)
        finally:
            left = self.active[principal] - 1
            if left:
                self.active[principal] = left
            else:
                del self.active[principal]


def limit_error(limit: int) -> types.CallToolResult:
    message = (
        f"Too many calls at once: {limit} of your calls are already running (limits.max_concurrent_per_principal). "
        "Nothing was executed or recorded. Wait for one to finish, then call again with the same "
        "idempotency_key; poll get_operation_status for the ones in progress."
    )
    # No code of its own for this: like retries_exhausted it is transient and certainly not
    # applied, so clients that already handle that code do the right thing.
    return render_error(GateError(ErrorCode.RETRIES_EXHAUSTED, message), replayed=False)
