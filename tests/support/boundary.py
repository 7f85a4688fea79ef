"""Shared parts of the boundary tests: a system of record that counts effects, a scripted tool source.

The system of record is a SQLite file (so several processes can count in it). It
does not deduplicate by key unless asked (`dedup=True` models a downstream API that
honours a forwarded Idempotency-Key): keeping effects exactly-once is commitgate's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from commitgate.server.core.boundary import CommitBoundary
from commitgate.server.core.requests import CallRequest, GuardedTool
from commitgate.server.ledger.base import Ledger
from commitgate.server.model.context import OperationContext
from commitgate.server.model.outcomes import AmbiguousError, PermanentError, RetryableError
from commitgate.server.model.records import ToolResult
from commitgate.server.policy.models import ServerPolicy, ToolPolicy

KEYED_CLASSES = ("key-required", "key-and-status-check", "compensable")


class Crash(BaseException):
    """The process dies here: nothing after this point runs, nothing more is recorded."""


class SystemOfRecord:
    """Effects in a SQLite file; a fresh connection per call so any thread or process may use it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._connect() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS effects (effect_id TEXT PRIMARY KEY, principal TEXT, session TEXT,"
                " key TEXT, tool TEXT, arguments TEXT, at REAL)"
            )

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout = 10000")
            conn.execute("PRAGMA synchronous = OFF")  # survives process kills; power loss is not tested
            yield conn
        finally:
            conn.close()

    def apply(
        self, ctx: OperationContext, arguments: dict[str, Any], *, dedup: bool = False
    ) -> dict[str, Any]:
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            if dedup and (found := self._find(conn, ctx)) is not None:
                conn.execute("COMMIT")
                return found
            effect_id = "fx_" + uuid.uuid4().hex[:12]
            conn.execute(
                "INSERT INTO effects VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    effect_id,
                    ctx.principal,
                    ctx.session,
                    ctx.idempotency_key,
                    ctx.tool,
                    _dump(arguments),
                    time.time(),
                ),
            )
            conn.execute("COMMIT")
        return {"effect_id": effect_id, "arguments": arguments}

    def find(self, ctx: OperationContext) -> dict[str, Any] | None:
        with self._connect() as conn:
            return self._find(conn, ctx)

    @staticmethod
    def _find(conn: sqlite3.Connection, ctx: OperationContext) -> dict[str, Any] | None:
        row = conn.execute(
            "SELECT effect_id, arguments FROM effects WHERE principal = ? AND session = ? AND key = ?"
            " ORDER BY rowid LIMIT 1",
            (ctx.principal, ctx.session, ctx.idempotency_key),
        ).fetchone()
        return None if row is None else {"effect_id": row[0], "arguments": json.loads(row[1])}

    def effect_ids(self) -> list[str]:
        with self._connect() as conn:
            return [row[0] for row in conn.execute("SELECT effect_id FROM effects ORDER BY rowid")]

    def count(self, **where: Any) -> int:
        clauses = " AND ".join(f"{column} = ?" for column in where) or "1"
        with self._connect() as conn:
            return int(
                conn.execute(
                    f"SELECT count(*) FROM effects WHERE {clauses}", tuple(where.values())
                ).fetchone()[0]
            )


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class ScriptedTool:
    """A tool source (tools/base.py's ToolSource shape) whose attempts follow a script.

    Attempt kinds, consumed one per attempt (then `default`):
      ok, retryable, retry_after:SECONDS, permanent, ambiguous_before, ambiguous_after (effect, then the
      answer is lost), error_after (effect, then a plain exception), timeout_after (effect, then no answer
      within the tool timeout), crash_before, crash_after (the process dies), slow (sleep, then ok),
      hold_before / hold_after (wait for `release()` before / after the effect), stale (wait for
      `release()`, then claim success without any effect: an owner that lost its lease); `held:KIND` waits
      for `release()`, then behaves as KIND.
    Status kinds, one per status check (then "lookup"): lookup, fail, none, held_lookup (look up now,
    answer after `release()`).
    With `dedup` (a downstream honouring the forwarded key) a request that reaches the downstream for a
    key it already applied is answered with the first response; failures before it gets there still happen.
    """

    description = "a scripted test tool"
    input_schema: dict[str, Any] = {"type": "object", "properties": {"amount": {"type": "integer"}}}  # noqa: RUF012
    output_schema: dict[str, Any] | None = None

    def __init__(
        self,
        record: SystemOfRecord,
        script: list[str] | None = None,
        status_script: list[str] | None = None,
        *,
        has_status_check: bool = True,
        dedup: bool = False,
        default: str = "ok",
        on_effect: Callable[[], None] | None = None,
        on_enter: Callable[[], None] | None = None,
        slow_seconds: float = 0.2,
    ) -> None:
        self.record = record
        self.script = list(script or [])
        self.status_script = list(status_script or [])
        self.has_status_check = has_status_check
        self.dedup = dedup
        self.default = default
        self.on_effect = on_effect
        self.on_enter = on_enter
        self.slow_seconds = slow_seconds
        self.calls = 0
        self.status_calls = 0
        self.contexts: list[OperationContext] = []
        self.entered = asyncio.Event()
        self._gate = asyncio.Event()

    def release(self) -> None:
        self._gate.set()

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return dict(arguments)

    def _effect(self, ctx: OperationContext, arguments: dict[str, Any]) -> dict[str, Any]:
        applied = self.record.apply(ctx, arguments, dedup=self.dedup)
        if self.on_effect is not None:
            self.on_effect()
        return applied

    async def call(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult:
        self.calls += 1
        self.contexts.append(ctx)
        kind = self.script.pop(0) if self.script else self.default
        self.entered.set()
        if self.on_enter is not None:
            self.on_enter()
        if kind.startswith("held:"):
            await self._gate.wait()
            kind = kind.removeprefix("held:")
        name, _, value = kind.partition(":")
        if self.dedup and name in ("ok", "permanent", "slow") and (first := self.record.find(ctx)):
            return ToolResult.of(first)  # the downstream knows the key: it answers with its first response
        if name == "stale":
            await self._gate.wait()
            return ToolResult.of({"effect_id": "stale-owner", "arguments": arguments})
        await self._before_effect(name, value)
        applied = self._effect(ctx, arguments)
        await self._after_effect(name)
        return ToolResult.of(applied)

    async def _before_effect(self, name: str, value: str) -> None:
        """Script steps that end (or delay) the attempt before anything happened in the world."""
        raised: dict[str, BaseException] = {
            "retryable": RetryableError("the service is busy"),
            "retry_after": RetryableError("rate limited", retry_after=float(value or 0)),
            "permanent": PermanentError("card declined"),
            "ambiguous_before": AmbiguousError("connection reset before the request was sent"),
            "crash_before": Crash(),
        }
        if name in raised:
            raise raised[name]
        if name == "hold_before":
            await self._gate.wait()
        if name == "slow":
            await asyncio.sleep(self.slow_seconds)

    async def _after_effect(self, name: str) -> None:
        """Script steps that lose or delay the answer after the effect happened."""
        if name == "ambiguous_after":
            raise AmbiguousError("the answer was lost after the service applied it")
        if name == "error_after":
            raise RuntimeError("socket closed while reading the answer")
        if name == "timeout_after":
            await asyncio.sleep(3600)
        if name == "crash_after":
            raise Crash
        if name == "hold_after":
            await self._gate.wait()

    async def status(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        self.status_calls += 1
        kind = self.status_script.pop(0) if self.status_script else "lookup"
        if kind == "fail":
            raise RuntimeError("the status API is down")
        if kind == "none":
            return None
        found = self.record.find(ctx)
        if kind == "held_lookup":  # the answer is computed now but delivered only after `release()`
            self.entered.set()
            await self._gate.wait()
        return None if found is None else ToolResult.of(found)


class FakeClock:
    """Time the boundary sees: leases, retention and deadlines move only when a test says so."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def guarded(name: str, cls: str, source: Any, **policy: Any) -> GuardedTool:
    """A guarded tool whose policy is what a `[tools.NAME]` table with these keys would give."""
    document: dict[str, Any] = {"class": cls, "python": f"tests:{name}", "timeout": "2s"}
    document["retry"] = {"attempts": 3, "initial": "0s", "max": "0s", **policy.pop("retry", {})}
    if cls == "key-and-status-check":
        document["status_check"] = f"tests:find_{name}"
    if cls == "compensable":
        document["compensate"] = {"tool": "undo", "arguments": {}}
    document.update(policy)
    return GuardedTool(name, ToolPolicy.model_validate(document), source)


def make_boundary(
    ledger: Ledger,
    tools: list[GuardedTool],
    *,
    clock: Callable[[], float] = time.time,
    owner: str | None = None,
    **server: Any,
) -> CommitBoundary:
    settings = ServerPolicy.model_validate({"lease": "10s", "in_progress_wait": "5s", **server})
    boundary = CommitBoundary(ledger, settings, {tool.name: tool for tool in tools}, clock=clock)
    if owner is not None:
        boundary.owner = owner
    return boundary


def call_request(
    tool: GuardedTool, key: str | None, amount: int = 500, *, session: str = "s1", principal: str = "alice"
) -> CallRequest:
    return CallRequest(tool, {"amount": amount}, key, session, principal)


def effect_of(result: ToolResult | None) -> str | None:
    """The effect id an answer reports (None when it reports none)."""
    if result is None or result.structured is None:
        return None
    return result.structured.get("effect_id")
