"""A test-only fault plan: faults injected at the commit boundary, for any tool.

`commitgate verify` and the pytest plugin start a server with a private token in the
environment variable `COMMITGATE_FAULT_TOKEN`. Only then does the server hold a fault
plan and answer the unlisted control tool `commitgate_faults` (every call must carry
the token), so a client of a normally started server can never turn faults on; a
server without the variable pays nothing per call: its handlers are chosen once, at start.

The plan arms, per tool, a number of:
  lose_answer  the next successful answer is dropped after the tool returned and its
               outcome was recorded: the client gets a JSON-RPC error, as if the
               response had been lost on the way back.
  fail_before  the next attempt fails with a transient error before the tool is called:
               nothing is executed, the boundary sees a `RetryableError`.
It also counts the tool's real invocations (attempts that reached the tool).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hmac
import json
import os
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mcp.types as types
from mcp import MCPError

from commitgate.server.model.context import OperationContext
from commitgate.server.model.events import OK, OWN_ERROR
from commitgate.server.model.outcomes import RetryableError
from commitgate.server.model.records import ToolResult
from commitgate.server.serve.envelope import Call, Reply, ReplyTo

ENV_TOKEN = "COMMITGATE_FAULT_TOKEN"
CONTROL_TOOL = "commitgate_faults"
LOST_ANSWER_CODE = -32099  # in the JSON-RPC range left to servers
LOST_ANSWER_MESSAGE = "commitgate fault plan: the answer was dropped after the tool returned"
ACTIONS = ("lose_answer", "fail_before", "counts", "clear")


class FaultySource:
    """A tool source seen through the fault plan: may fail before the call, counts real calls."""

    def __init__(self, name: str, source: Any, plan: FaultPlan) -> None:
        self._name, self._source, self._plan = name, source, plan

    def __getattr__(self, attribute: str) -> Any:  # schemas, description, has_status_check...
        return getattr(self._source, attribute)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._source.validate(arguments)
        return result

    async def call(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult:
        if self._plan.take("fail_before", self._name):
            raise RetryableError(f"injected by the fault plan: {self._name} failed before it was called")
        self._plan.invocations[self._name] += 1
        result: ToolResult = await self._source.call(arguments, ctx)
        return result

    async def status(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        found: ToolResult | None = await self._source.status(arguments, ctx)
        return found


@dataclass
class FaultPlan:
    token: str
    armed: dict[str, Counter[str]] = field(
        default_factory=lambda: {"lose_answer": Counter(), "fail_before": Counter()}
    )
    invocations: Counter[str] = field(default_factory=Counter)

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        """The plan if this process was started with a fault token; the variable is then removed so
        that tools and child processes never see it."""
        token = os.environ.get(ENV_TOKEN, "")
        _scrub(ENV_TOKEN)
        os.environ.pop(ENV_TOKEN, None)
        return cls(token) if len(token) >= 16 else None

    def take(self, kind: str, tool: str) -> bool:
        armed = self.armed[kind]
        if armed[tool] <= 0:
            return False
        armed[tool] -= 1
        return True

    def wrap(self, served: Mapping[str, Any]) -> dict[str, Any]:
        """The served tools, each with its source seen through this plan (ServedTool instances)."""
        wrapped = {}
        for name, tool in served.items():
            source = tool.guard.source
            if not isinstance(source, FaultySource):
                source = FaultySource(name, source, self)
            guard = dataclasses.replace(tool.guard, source=source)
            wrapped[name] = dataclasses.replace(tool, guard=guard)
        return wrapped

    def around(self, call: ReplyTo) -> ReplyTo:
        """`call` (the gateway's tools/call) with the control tool and the dropped answers added."""

        async def call_tool(request: Call) -> Reply:
            if request.name == CONTROL_TOOL:
                return self.control(dict(request.arguments or {}))
            reply = await call(request)
            if reply.code == OK and self.take("lose_answer", request.name):
                raise MCPError(LOST_ANSWER_CODE, LOST_ANSWER_MESSAGE)
            return reply

        return call_tool

    def control(self, arguments: dict[str, Any]) -> Reply:
        token = arguments.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            return _answer({"error": "wrong or missing token"}, error=True)
        action, tool, times = arguments.get("action"), arguments.get("tool"), arguments.get("times", 1)
        if action in ("lose_answer", "fail_before"):
            if not isinstance(tool, str) or not isinstance(times, int) or times < 0:
                return _answer({"error": "pass tool (a name) and times (an integer >= 0)"}, error=True)
            self.armed[action][tool] = times
        elif action == "clear":
            for armed in self.armed.values():
                armed.clear()
            self.invocations.clear()
        elif action != "counts":
            return _answer({"error": f"action must be one of {', '.join(ACTIONS)}"}, error=True)
        return _answer(self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        return {
            "invocations": dict(self.invocations),
            "armed": {kind: {t: n for t, n in armed.items() if n > 0} for kind, armed in self.armed.items()},
        }


def _scrub(name: str) -> None:
    """Overwrite the variable's value where the process received it: removing it from os.environ
    leaves that copy readable in /proc/PID/environ (Linux) by anyone who may read the process."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_void_p
        address = libc.getenv(name.encode())
        if address:
            ctypes.memset(address, 0, len(ctypes.string_at(address)))


def _answer(value: dict[str, Any], *, error: bool = False) -> Reply:
    text = json.dumps(value, separators=(",", ":"))
    result = types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], structured_content=value, is_error=error
    )
    return Reply(result, OWN_ERROR, message=value["error"]) if error else Reply(result)
