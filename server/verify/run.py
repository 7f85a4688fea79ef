"""`commitgate verify`: the three tests every write tool must pass, and the policy's claims about it.

Through a real server over the user's policy (its own temporary ledger, a fault plan):
  1. lost answer after success: the answer is dropped after the tool returned; the retry
     with the same key must not add an effect.
  2. failure before the call: a transient failure before the tool is called; the retry
     must run it for real, exactly once.
  3. concurrent duplicates: N calls with one key at once; one effect, every caller gets
     the recorded outcome.
Then, calling the tool's source directly (as the boundary does): its status check must
find what the tool just did under that key and say "not found" for a key never used; a
tool that claims `forwards_key` must leave one effect when called twice with one key.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from mcp import MCPError
from mcp.types import CallToolResult

from commitgate.server.ledger import OperationFilter
from commitgate.server.model.context import OperationContext
from commitgate.server.model.facts import OPERATION_META, IdempotencyClass, State
from commitgate.server.model.records import Operation, ToolResult
from commitgate.server.policy.loading import default_policy, load_policy
from commitgate.server.policy.models import Policy, ToolPolicy
from commitgate.server.policy.problems import PolicyError
from commitgate.server.serve.gateway import local_principal
from commitgate.server.serve.registry import ServedTool, build_tools
from commitgate.server.verify.effects import (
    CouldNotRun,
    CountedBy,
    Evidence,
    context_for,
    count_with,
    load_count_function,
)
from commitgate.server.verify.harness import Gate, GateError, lost_answer, start_gate

SETTLE_TRIES = 50  # re-asks of a call that answered operation_in_progress, 0.2 s apart


@dataclass(frozen=True)
class Options:
    tool: str
    arguments: dict[str, Any]
    policy: Path | None = None
    count: str | None = None
    concurrency: int = 8


@dataclass(frozen=True)
class Check:
    name: str
    kind: str  # "test" or "claim"
    passed: bool | None  # None: did not apply
    detail: str
    evidence: Evidence | None = None

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "FAIL", None: "skipped"}[self.passed]

    def to_json(self) -> dict[str, Any]:
        view: dict[str, Any] = {"name": self.name, "kind": self.kind, "verdict": self.verdict.lower()}
        view["detail"] = self.detail
        if self.evidence is not None:
            view["effects"] = self.evidence.effects
            view["found"] = self.evidence.found
            view["invocations"] = self.evidence.invocations
        return view


@dataclass
class Report:
    tool: str
    idempotency_class: str
    policy: str
    counted_by: CountedBy
    counting: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check.passed is not False for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "class": self.idempotency_class,
            "policy": self.policy,
            "counted_by": self.counted_by.value,
            "counting": self.counting,
            "verdict": "pass" if self.passed else "fail",
            "checks": [check.to_json() for check in self.checks],
        }


# --- setting up ------------------------------------------------------------------------------------


def load(options: Options) -> tuple[Policy, dict[str, Any]]:
    """The policy and the arguments without a key; every mistake a one-line reason."""
    try:
        policy = load_policy(options.policy) if options.policy is not None else default_policy()
    except PolicyError as exc:
        first = exc.problems[0] if exc.problems else "invalid"
        raise CouldNotRun(f"the policy has problems ({first}); see `commitgate policy check`") from None
    if options.tool not in policy.tools and not _serves_all(policy):
        raise CouldNotRun(f"the policy has no tool {options.tool!r}; it has: {', '.join(policy.tools)}")
    arguments = dict(options.arguments)
    arguments.pop("idempotency_key", None)  # verify chooses its own keys
    return policy, arguments


def _serves_all(policy: Policy) -> bool:
    return any(spec.tools == "all" for spec in policy.upstreams.values())


def served_tool(served: dict[str, ServedTool], options: Options) -> ServedTool:
    """The tool as the server serves it: a policy entry, or a tool of a `tools = "all"` upstream
    (known only once its upstream listed its tools)."""
    tool = served.get(options.tool)
    if tool is None:
        raise CouldNotRun(
            f"the policy serves no tool {options.tool!r}; it serves: {', '.join(sorted(served))}"
            ' (tools of a `tools = "all"` upstream count once it answers)'
        )
    if not tool.exposed:
        raise CouldNotRun(f"{options.tool} is not exposed (expose = false): agents cannot call it")
    return tool


@contextlib.asynccontextmanager
async def built_tools(policy: Policy, path: Path | None) -> AsyncIterator[dict[str, ServedTool]]:
    """The policy's tools built in this process (upstreams connected), for direct calls."""
    from commitgate.tools.base import Collaborators
    from commitgate.tools.http import pooled_client
    from commitgate.tools.upstream import UpstreamManager

    upstreams, http = UpstreamManager(), pooled_client()
    try:
        try:
            await upstreams.update(policy)
            using = Collaborators(http=http, upstream=upstreams.lookup(policy))
            served = build_tools(policy, path.parent if path else None, using)
        except Exception as exc:
            raise CouldNotRun(f"the policy's tools could not be built: {exc}") from None
        yield served
    finally:
        await upstreams.aclose()
        await http.aclose()


def _yes() -> bool:
    return True


async def verify(options: Options, confirm: Callable[[], bool] = _yes) -> Report:
    """Run the tests; `confirm` is asked once the input is known good, before the first real effect."""
    policy, arguments = load(options)
    search = [Path.cwd(), *([options.policy.resolve().parent] if options.policy else [])]
    counter = load_count_function(options.count, search) if options.count else None
    async with built_tools(policy, options.policy) as served:
        guard = served_tool(served, options).guard
        source, tool_policy = guard.source, guard.policy
        try:
            arguments = source.validate(arguments)
        except Exception as exc:
            raise CouldNotRun(f"--arguments do not match {options.tool}'s input schema: {exc}") from None
        verifier = Verifier(options, policy, tool_policy, source, arguments, counter)
        await verifier.preflight()
        if not confirm():
            raise CouldNotRun("not confirmed; pass --yes to run the tests")
        with tempfile.TemporaryDirectory(prefix="commitgate-verify-") as workdir:
            try:
                async with start_gate(options.policy, Path(workdir)) as gate:
                    await gate.serving(options.tool, _connect_bound(policy, tool_policy))
                    return await verifier.run(gate)
            except GateError as exc:
                raise CouldNotRun(str(exc)) from None


def _connect_bound(policy: Policy, tool: ToolPolicy) -> float:
    """How long the server may take to serve the tool: its upstream's connect timeout, if any."""
    upstream = policy.upstreams.get(tool.upstream) if tool.upstream else None
    return upstream.connect_timeout if upstream is not None else 0.0


# --- the tests -------------------------------------------------------------------------------------


@dataclass
class Verifier:
    options: Options
    policy: Policy
    tool_policy: ToolPolicy
    source: Any
    arguments: dict[str, Any]
    counter: Callable[[str], Any] | None
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))
    _gate: Gate | None = None

    @property
    def tool(self) -> str:
        return self.options.tool

    def session(self, key: str) -> str:
        """Each test in a session of its own: the tests repeat the same arguments under new keys, which
        in one session duplicate detection would (rightly) refuse as a re-issue of the same action."""
        return f"commitgate-{key}"

    @property
    def principal(self) -> str:
        return self.policy.server.principal or local_principal()

    @property
    def gate(self) -> Gate:
        assert self._gate is not None
        return self._gate

    @property
    def counted_by(self) -> CountedBy:
        if self.counter is not None:
            return CountedBy.COUNT_FUNCTION
        if self.source.has_status_check and self.tool_policy.idempotency_class.keyed:
            return CountedBy.STATUS_CHECK
        return CountedBy.INVOCATIONS

    def key(self, purpose: str) -> str:
        return f"verify-{self.run_id}-{purpose}"

    async def preflight(self) -> None:
        """Before any effect: the count function answers, and says 0 for a key never used."""
        if self.counter is None:
            return
        assert self.options.count is not None
        seen = await count_with(self.counter, self.options.count, self.key("never-used"))
        if seen != 0:
            raise CouldNotRun(f"--count {self.options.count!r} says {seen} effect(s) for a key never used")

    async def run(self, gate: Gate) -> Report:
        self._gate = gate
        report = Report(
            self.tool,
            self.tool_policy.idempotency_class.value,
            str(self.options.policy or "bundled demo policy"),
            self.counted_by,
            self.counted_by.explain(f"--count {self.options.count}"),
        )
        report.checks.append(await self.lost_answer())
        report.checks.append(await self.failure_before())
        report.checks.append(await self.concurrent())
        report.checks.extend(await self.claims())
        return report

    async def call(self, key: str) -> CallToolResult:
        return await self.gate.call(self.tool, self.arguments, key=key, session=self.session(key))

    async def lost_answer(self) -> Check:
        key, before = self.key("lost-answer"), await self.gate.invocations(self.tool)
        await self.gate.lose_next_answer(self.tool)
        try:
            first = await self.call(key)
        except MCPError as exc:
            if not lost_answer(exc):
                raise CouldNotRun(f"the server refused the call: {exc}") from None
        else:  # only a success is dropped: this call failed for real
            raise CouldNotRun(f"the first call failed, so nothing could be tested: {_text(first)}")
        retry = await self.call(key)
        evidence = await self.evidence(key, before)
        passed = not retry.is_error and evidence.exactly_one()
        if retry.is_error:
            detail = f"the retry answered {_text(retry)}"
        elif _replayed(retry):
            detail = "the retry got the recorded outcome"
        else:
            detail = "the retry ran the tool again"
        if not passed and self.tool_policy.idempotency_class is IdempotencyClass.SAFE_RETRY:
            detail += "; safe-retry calls are not deduplicated: declare a keyed class for a write tool"
        return Check("lost answer after success", "test", passed, detail, evidence)

    async def failure_before(self) -> Check:
        key, before = self.key("fail-before"), await self.gate.invocations(self.tool)
        await self.gate.fail_next_before(self.tool)
        answer = await self.call(key)
        how = "the boundary retried it"
        if answer.is_error and _code(answer) == "retries_exhausted":
            answer, how = await self.call(key), "the retry with the same key ran it"
        evidence = await self.evidence(key, before)
        passed = not answer.is_error and evidence.exactly_one()
        detail = f"the retry answered {_text(answer)}" if answer.is_error else how
        return Check("failure before the call", "test", passed, detail, evidence)

    async def concurrent(self) -> Check:
        n = self.options.concurrency
        key, before = self.key("concurrent"), await self.gate.invocations(self.tool)
        answers: list[CallToolResult | None] = [None] * n

        async def one(index: int) -> None:
            answers[index] = await self.settled(key)

        async with anyio.create_task_group() as group:
            for index in range(n):
                group.start_soon(one, index)
        evidence = await self.evidence(key, before)
        errors = [a for a in answers if a is None or a.is_error]
        distinct = {json.dumps(a.structured_content, sort_keys=True) for a in answers if a and not a.is_error}
        passed = not errors and len(distinct) == 1 and evidence.exactly_one()
        detail = f"{n - len(errors)} of {n} got a result, {len(distinct)} distinct"
        if errors:
            detail += f"; {len(errors)} error(s), e.g. {_text(errors[0]) if errors[0] else 'no answer'}"
        return Check(f"{n} concurrent duplicates", "test", passed, detail, evidence)

    async def settled(self, key: str) -> CallToolResult:
        """The call's answer, asked again while it says operation_in_progress (as an agent polls)."""
        answer = await self.call(key)
        for _ in range(SETTLE_TRIES):
            if _code(answer) != "operation_in_progress":
                break
            await anyio.sleep(0.2)
            answer = await self.call(key)
        return answer

    # --- counting ----------------------------------------------------------------------------------

    async def evidence(self, key: str, before: int) -> Evidence:
        invocations = await self.gate.invocations(self.tool) - before
        if self.counter is not None:
            assert self.options.count is not None
            return Evidence(await count_with(self.counter, self.options.count, key), None, invocations)
        if self.counted_by is CountedBy.STATUS_CHECK:
            found, error = await self.status(await self.context(key))
            if error is None:  # a check that cannot tell leaves the invocation count (its claim fails)
                return Evidence(None, found is not None, invocations)
        return Evidence(None, None, invocations)

    async def operation(self, key: str) -> Operation | None:
        found = await self.gate.ledger.find(
            OperationFilter(None, self.session(key), None, self.tool, limit=1000)
        )
        return next((op for op in found if op.step == key), None)

    async def context(self, key: str) -> OperationContext:
        op = await self.operation(key)
        if op is None:
            return context_for(key, self.session(key), self.principal, self.tool)
        return OperationContext(op.step, op.session, op.operation_id, op.attempts, op.principal, self.tool)

    async def status(self, ctx: OperationContext) -> tuple[ToolResult | None, str | None]:
        """The status check's answer, or the reason it could not tell."""
        try:
            return await self.source.status(self.arguments, ctx), None
        except Exception as exc:
            return None, str(exc) or type(exc).__name__

    # --- the policy's claims -----------------------------------------------------------------------

    async def claims(self) -> list[Check]:
        checks = []
        if self.source.has_status_check:
            checks += [await self.status_finds_own(), await self.status_not_found()]
        if self.tool_policy.forwards_key:
            checks.append(await self.forwards_key())
        return checks

    async def status_finds_own(self) -> Check:
        name, key = "status check finds the tool's effect", self.key("lost-answer")
        op = await self.operation(key)
        if op is None or op.state is not State.SUCCEEDED:
            return Check(name, "claim", None, "no recorded success to look for")
        found, error = await self.status(await self.context(key))
        if error is not None:
            return Check(name, "claim", False, f"it could not tell (it raised: {_line(error)})")
        if found is None:
            return Check(name, "claim", False, f"it said not found for what the tool did under key {key}")
        return Check(name, "claim", True, f"it found what the tool did under key {key}")

    async def status_not_found(self) -> Check:
        name, key = "status check: not found for a new key", self.key("never-used")
        found, error = await self.status(context_for(key, self.session(key), self.principal, self.tool))
        if error is not None:
            return Check(name, "claim", False, f"it raised instead of saying not found: {_line(error)}")
        if found is not None:
            return Check(name, "claim", False, f"it found an effect for key {key}, which was never used")
        return Check(name, "claim", True, "it said not found")

    async def forwards_key(self) -> Check:
        name, key = "forwards_key: the downstream dedups", self.key("direct")
        ctx = context_for(key, self.session(key), self.principal, self.tool)
        try:
            first = await self.source.call(self.arguments, ctx)
            second = await self.source.call(self.arguments, ctx)
        except Exception as exc:
            return Check(
                name, "claim", False, f"a direct call failed: {_line(str(exc) or type(exc).__name__)}"
            )
        if self.counter is not None:
            assert self.options.count is not None
            effects = await count_with(self.counter, self.options.count, key)
            evidence = Evidence(effects, None, 2)
            detail = f"two direct calls with key {key} left {effects} effect(s)"
            return Check(name, "claim", effects == 1, detail, evidence)
        same = first == second
        detail = "the second direct call " + (
            "answered the first result" if same else "answered a new result"
        )
        return Check(name, "claim", same, detail + " (compared answers; pass --count to count effects)")


def _code(result: CallToolResult) -> str | None:
    if not result.is_error or not isinstance(result.structured_content, dict):
        return None
    error = result.structured_content.get("error")
    return str(error.get("code")) if isinstance(error, dict) else None


def _text(result: CallToolResult) -> str:
    texts = [getattr(block, "text", "") for block in result.content]
    return _line(" ".join(t for t in texts if t) or "an error without text")


def _line(text: str, limit: int = 300) -> str:
    one = " ".join(text.split())
    return one if len(one) <= limit else one[: limit - 1] + "…"


def _replayed(result: CallToolResult) -> bool:
    return bool(((result.meta or {}).get(OPERATION_META) or {}).get("replayed"))
