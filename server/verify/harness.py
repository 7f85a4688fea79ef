"""A real commitgate server for tests: a child process over a policy, a private ledger, a fault plan.

`start_gate()` runs `commitgate serve` over stdio with a fresh SQLite ledger in a
directory of the caller's and a private fault token, connects an MCP client, and
hands back a `Gate`: the client, the faults it may inject at the boundary, and the
ledger's own account of what was executed. `commitgate verify` and the pytest plugin
are both built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import CallToolResult, RequestParamsMeta

from commitgate.server.core.views import status_view
from commitgate.server.ledger import Ledger, OperationFilter, open_ledger
from commitgate.server.model.facts import SESSION_META, IdempotencyClass, State
from commitgate.server.policy.loading import default_policy, load_policy
from commitgate.server.policy.models import Policy
from commitgate.server.serve.faults import CONTROL_TOOL, ENV_TOKEN, LOST_ANSWER_CODE

EFFECT_STATES = (State.SUCCEEDED, State.COMPENSATED)  # an execution that succeeded (undone or not)


class _QuietControl(logging.Filter):
    """The control tool is deliberately unlisted; the client need not warn that it cannot check it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return CONTROL_TOOL not in record.getMessage()


logging.getLogger("client").addFilter(_QuietControl())


class GateError(Exception):
    """The test server could not be started or asked: a one-line reason."""


def lost_answer(exc: BaseException) -> bool:
    """True for the error a client sees when the fault plan dropped an answer."""
    return isinstance(exc, MCPError) and exc.code == LOST_ANSWER_CODE


@dataclass
class Gate:
    """A running test server: its MCP client, its fault plan and its ledger."""

    client: Client
    policy: Policy
    ledger: Ledger
    ledger_url: str
    stderr: Path
    _token: str

    # --- calling tools -------------------------------------------------------------------------

    async def call(
        self,
        tool: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        session: str | None = None,
    ) -> CallToolResult:
        """Call `tool` as an agent would: `key` becomes the idempotency_key, `session` goes in `_meta`."""
        args = dict(arguments or {})
        if key is not None:
            args["idempotency_key"] = key
        meta = cast(RequestParamsMeta, {SESSION_META: session}) if session is not None else None
        return await self.client.call_tool(tool, args, meta=meta)

    async def serving(self, tool: str, within: float) -> None:
        """Return once the server lists `tool`: a `tools = "all"` upstream's tools appear only when
        it has connected (at most `within` seconds, its connect timeout)."""
        deadline = time.monotonic() + within
        while tool not in {t.name for t in (await self.client.list_tools()).tools}:
            if time.monotonic() >= deadline:
                raise GateError(f"the server did not list {tool} within {within:g} s of starting")
            await asyncio.sleep(0.1)

    # --- faults at the boundary ----------------------------------------------------------------

    async def lose_next_answer(self, tool: str, times: int = 1) -> None:
        """The next `times` successful answers of `tool` are dropped after its outcome was recorded."""
        await self._control("lose_answer", tool=tool, times=times)

    async def fail_next_before(self, tool: str, times: int = 1) -> None:
        """The next `times` attempts of `tool` fail transiently before it is called (nothing executes)."""
        await self._control("fail_before", tool=tool, times=times)

    async def invocations(self, tool: str) -> int:
        """How many attempts reached the tool itself (injected failures not included)."""
        counts = await self._control("counts")
        return int(counts["invocations"].get(tool, 0))

    async def clear_faults(self) -> None:
        await self._control("clear")

    async def _control(self, action: str, **arguments: Any) -> dict[str, Any]:
        result = await self.client.call_tool(
            CONTROL_TOOL, {"token": self._token, "action": action, **arguments}
        )
        if result.is_error or result.structured_content is None:
            raise GateError(f"the fault plan refused {action}: {result.structured_content}")
        return dict(result.structured_content)

    # --- what the ledger says ------------------------------------------------------------------

    async def operations(
        self, tool: str | None = None, *, session: str | None = None, state: State | str | None = None
    ) -> list[dict[str, Any]]:
        """Operations of the ledger (every principal), oldest first, as get_operation_status shows them."""
        wanted = State(state) if isinstance(state, str) else state
        found = await self.ledger.find(OperationFilter(None, session, wanted, tool, limit=100_000))
        found.sort(key=lambda op: op.created_at)
        return [status_view(op, self._forwards_key(op.tool)) for op in found]

    async def effects(self, tool: str, *, session: str | None = None) -> list[dict[str, Any]]:
        """The executions of `tool` that succeeded (one per operation: replays are not executions)."""
        await self._keyed(tool)
        operations = await self.operations(tool, session=session)
        return [op for op in operations if op["state"] in {s.value for s in EFFECT_STATES}]

    async def assert_effects(self, tool: str, *, exactly: int, session: str | None = None) -> None:
        """Fail unless exactly `exactly` executions of `tool` succeeded (in `session`, if given)."""
        effects = await self.effects(tool, session=session)
        if len(effects) != exactly:
            where = f" in session {session!r}" if session is not None else ""
            keys = ", ".join(f"{op['session']}/{op['idempotency_key']}" for op in effects) or "none"
            raise AssertionError(
                f"expected exactly {exactly} succeeded execution(s) of {tool}{where}, "
                f"the ledger holds {len(effects)} (session/key: {keys})"
            )

    async def _keyed(self, tool: str) -> None:
        policy = self.policy.tools.get(tool)
        keyed = policy.idempotency_class is not IdempotencyClass.SAFE_RETRY if policy else None
        if keyed is None:  # no entry: a tool of a `tools = "all"` upstream, keyed when it takes a key
            listed = {t.name: t for t in (await self.client.list_tools()).tools}
            if tool not in listed:
                served = ", ".join(sorted(listed))
                raise GateError(f"the server serves no tool {tool!r} (yet); it serves: {served}")
            keyed = "idempotency_key" in listed[tool].input_schema.get("required", [])
        if not keyed:
            raise GateError(
                f"{tool} is safe-retry: its calls are not recorded in the ledger; "
                f"count its calls with invocations({tool!r})"
            )

    def _forwards_key(self, tool: str) -> bool:
        policy = self.policy.tools.get(tool)
        return bool(policy and policy.forwards_key)


def server_parameters(
    policy_path: Path | None, ledger_url: str, token: str, env: Mapping[str, str] | None = None
) -> StdioServerParameters:
    args = ["-m", "commitgate.server.cli", "serve", "--ledger", ledger_url]
    if policy_path is not None:
        args += ["--policy", str(policy_path)]
    environment = {**os.environ, **(env or {}), ENV_TOKEN: token}
    return StdioServerParameters(command=sys.executable, args=args, env=environment)


@contextlib.asynccontextmanager
async def start_gate(
    policy_path: Path | None,
    workdir: Path,
    *,
    env: Mapping[str, str] | None = None,
    read_timeout: float = 60.0,
) -> AsyncIterator[Gate]:
    """A server over `policy_path` (None: the bundled demo policy) with its ledger in `workdir`."""
    policy = load_policy(policy_path) if policy_path is not None else default_policy()
    workdir.mkdir(parents=True, exist_ok=True)
    ledger_url = f"sqlite:///{(workdir / 'ledger.db').resolve()}"
    token = secrets.token_urlsafe(24)
    stderr = workdir / "server.stderr"
    parameters = server_parameters(policy_path, ledger_url, token, env)
    with stderr.open("w", encoding="utf-8") as errlog:
        try:
            async with contextlib.AsyncExitStack() as stack:
                try:
                    client = await stack.enter_async_context(
                        Client(stdio_client(parameters, errlog=errlog), read_timeout_seconds=read_timeout)
                    )
                    ledger = await open_ledger(ledger_url)
                except Exception as exc:  # the server did not come up: say why, in its own words
                    errlog.flush()
                    raise GateError(f"the server did not start: {last_line(stderr) or exc}") from None
                stack.push_async_callback(ledger.close)
                yield Gate(client, policy, ledger, ledger_url, stderr, token)
        except BaseExceptionGroup as group:  # the client's task group wraps what the caller raised
            raise _alone(group) from None


def _alone(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception inside (nested) groups of one, else the group itself."""
    inner: BaseException = group
    while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
        inner = inner.exceptions[0]
    return inner


def last_line(path: Path) -> str:
    """The last non-empty line the server wrote to stderr (its reason, when it could not start)."""
    with contextlib.suppress(OSError):
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return lines[-1] if lines else ""
    return ""
