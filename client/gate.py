"""`Gate`: guarded calls whose keys come from durable state, not from a random value per retry.

A workflow run has a durable id (`session`), and each of its actions a stable name (`step`).
Together they are the operation's key: the same run calling the same step again, after a lost
answer, a crash or a restart, gets the first outcome instead of acting twice. A new run is a
new session, so its steps are new actions.

`Gate.call` sends the two in `_meta` (`commitgate/session`, `commitgate/step`), waits out
`operation_in_progress` and `approval_pending` by polling `get_operation_status` with backoff
and full jitter, and turns every other error into a typed exception carrying the operation view.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from commitgate.client.errors import (
    ApprovalDenied,
    CommitgateError,
    OperationFailed,
    OutcomeUnknown,
    StillRunning,
    error_for,
)

SESSION_META = "commitgate/session"
STEP_META = "commitgate/step"
OPERATION_META = "commitgate/operation"

_WAIT = frozenset({"operation_in_progress", "approval_pending"})  # poll, then decide
_AGAIN = frozenset({"ledger_unavailable"})  # nothing was recorded: the same key may be sent again


class ToolCaller(Protocol):
    """What Gate needs of an MCP client: `mcp.Client` and `mcp.ClientSession` both fit."""

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *, meta: Any = None
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class GateResult:
    """A tool's answer: its content and structured content, and the operation it belongs to."""

    content: list[Any]
    structured: dict[str, Any] | None
    operation: dict[str, Any]
    replayed: bool

    @property
    def text(self) -> str:
        return "\n".join(_text(block) for block in self.content if _text(block))


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: each wait is drawn uniformly below its cap."""

    initial: float = 0.1
    maximum: float = 5.0
    multiplier: float = 2.0
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, attempt: int) -> float:
        cap = min(self.maximum, self.initial * self.multiplier ** max(0, attempt))
        return self.rng.uniform(0, cap)


class Gate:
    """Guarded calls for one durable run (`session`); see the module docstring."""

    def __init__(
        self,
        client: ToolCaller,
        session: str,
        *,
        wait: float = 300.0,
        backoff: Backoff | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(session, str) or not 1 <= len(session) <= 255:
            raise ValueError("session must be a string of 1-255 characters (e.g. a workflow run id)")
        self.client = client
        self.session = session
        self.wait = wait  # how long one call waits for a running or awaiting operation, in seconds
        self.backoff = backoff or Backoff()
        self._sleep = sleep
        self._clock = clock

    def meta(self, step: str) -> dict[str, str]:
        return {SESSION_META: self.session, STEP_META: step}

    async def call(
        self,
        tool: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        step: str,
        confirm_duplicate: bool = False,
    ) -> GateResult:
        """Run `tool` as step `step` of this run: exactly once, however often this is called."""
        args = dict(arguments or {})
        if confirm_duplicate:
            args["confirm_duplicate"] = True
        deadline = self._clock() + self.wait
        tries = 0
        while True:
            result = await self.client.call_tool(tool, args, meta=self.meta(step))
            if not _is_error(result):
                return _from_result(result)
            error = _error_block(result)
            code = str(error.get("code"))
            if code in _AGAIN:
                tries = await self._pause(tries, deadline, error)
                continue
            if code not in _WAIT:
                raise error_for(error)
            view = await self._until_settled(step, deadline, error)
            if view.get("retry_advice") == "safe_to_retry_same_key":
                continue  # approved, or certainly not applied: the same key runs it now
            return _settled(view)

    async def status(self, step: str) -> dict[str, Any] | None:
        """The operation of `step` in this run as get_operation_status shows it (None: not recorded)."""
        result = await self.client.call_tool(
            "get_operation_status", {"idempotency_key": step, "session": self.session}, meta=self.meta(step)
        )
        if _is_error(result):
            raise error_for(_error_block(result))
        structured = _structured(result) or {}
        return cast(dict[str, Any] | None, structured.get("operation"))

    async def _until_settled(self, step: str, deadline: float, error: dict[str, Any]) -> dict[str, Any]:
        """Poll until the server's retry_advice is no longer wait_and_poll."""
        polls = 0
        while True:
            polls = await self._pause(polls, deadline, error)
            view = await self.status(step)
            if view is None:  # not recorded (purged, or never claimed): the same key is safe
                return {"retry_advice": "safe_to_retry_same_key"}
            if view.get("retry_advice") != "wait_and_poll":
                return view
            error = {**error, "operation": view}

    async def _pause(self, attempt: int, deadline: float, error: dict[str, Any]) -> int:
        delay = self.backoff.delay(attempt)
        if self._clock() + delay > deadline:
            raise StillRunning(
                str(error.get("code", "operation_in_progress")),
                f"still not settled after waiting {self.wait:g}s; it continues on the server: call again "
                "later with the same session and step",
                error.get("operation"),
            )
        await self._sleep(delay)
        return attempt + 1


def _settled(view: dict[str, Any]) -> GateResult:
    """The answer a settled status view stands for: its result, or the matching error."""
    state = view.get("state")
    recorded = view.get("result")
    if state in ("SUCCEEDED", "COMPENSATED") and isinstance(recorded, dict):
        return GateResult(list(recorded.get("content") or []), recorded.get("structuredContent"), view, True)
    failure = view.get("error") if isinstance(view.get("error"), dict) else {}
    message = str((failure or {}).get("message") or f"the operation ended in state {state}")
    code = str((failure or {}).get("code") or "")
    if code.startswith("approval_"):
        raise ApprovalDenied(code, message, view)
    if state == "UNKNOWN":
        raise OutcomeUnknown("operation_outcome_unknown", message, view)
    if state in ("FAILED_FINAL", "FAILED_RETRYABLE"):
        raise OperationFailed(
            "operation_failed" if state == "FAILED_FINAL" else "retries_exhausted", message, view
        )
    raise CommitgateError(code or "unexpected_state", message, view)


def _is_error(result: Any) -> bool:
    flag = getattr(result, "is_error", None)  # SDK v2; v1 calls it isError (v2 warns when it is read)
    return bool(getattr(result, "isError", False) if flag is None else flag)


def _structured(result: Any) -> dict[str, Any] | None:
    value = getattr(result, "structured_content", None)
    if value is None:
        value = getattr(result, "structuredContent", None)
    return value if isinstance(value, dict) else None


def _error_block(result: Any) -> dict[str, Any]:
    error = (_structured(result) or {}).get("error")
    if isinstance(error, dict) and "code" in error:
        return error
    text = " ".join(_text(block) for block in getattr(result, "content", []) or [])
    return {"code": "tool_error", "message": text or "the tool answered an error without details"}


def _from_result(result: Any) -> GateResult:
    meta = getattr(result, "meta", None) or {}
    operation = dict(meta.get(OPERATION_META) or {}) if isinstance(meta, Mapping) else {}
    content = list(getattr(result, "content", []) or [])
    return GateResult(content, _structured(result), operation, bool(operation.get("replayed")))


def _text(block: Any) -> str:
    if isinstance(block, Mapping):
        return str(block.get("text") or "")
    return str(getattr(block, "text", "") or "")
