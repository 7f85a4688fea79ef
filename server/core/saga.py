"""Compensation: undo a session's succeeded compensable operations, in reverse order, exactly once.

Each compensation is itself a keyed operation in the ledger, keyed
deterministically from the forward operation (`compensate:<operation_id>`),
so running `compensate_session` twice, concurrently or after a crash replays
the first compensation instead of undoing twice. The forward operation turns
`COMPENSATED` only after its compensation succeeded; a crash in between is
finished by the next call (the compensation replays, then the mark is set).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from commitgate.server.core import errors
from commitgate.server.core.boundary import CommitBoundary
from commitgate.server.core.requests import Answer, CallRequest, GuardedTool, RunSettings
from commitgate.server.ledger.base import Ledger, OperationFilter, Transition
from commitgate.server.model.audit import Actor, AuditEvent
from commitgate.server.model.facts import REFERENCE, IdempotencyClass, State
from commitgate.server.model.records import Operation
from commitgate.server.policy.models import CompensateSpec

_SESSION_SCAN_LIMIT = 10_000


class TemplateError(Exception):
    """A compensation argument refers to something the forward call does not have."""


def compensation_key(forward: Operation) -> str:
    return f"compensate:{forward.operation_id}"


def _lookup(root: Any, path: list[str], whole: str) -> Any:
    value = root
    for part in path:
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise TemplateError(f"{whole} is not in the forward call")
    return value


def render_arguments(template: Any, arguments: Mapping[str, Any], result: Any) -> Any:
    """Fill `{arguments.X}` / `{result.X}` (nested paths allowed); a lone placeholder keeps its type."""
    if isinstance(template, Mapping):
        return {key: render_arguments(value, arguments, result) for key, value in template.items()}
    if isinstance(template, list):
        return [render_arguments(value, arguments, result) for value in template]
    if not isinstance(template, str):
        return template
    roots = {"arguments": arguments, "result": result}

    def value_of(match: re.Match[str]) -> Any:
        return _lookup(roots[match.group(1)], match.group(2).split(".")[1:], match.group(0))

    whole = REFERENCE.fullmatch(template)
    if whole:
        return value_of(whole)
    return REFERENCE.sub(lambda m: str(value_of(m)), template)


@dataclass(frozen=True, slots=True)
class Saga:
    ledger: Ledger
    boundary: CommitBoundary
    tools: Mapping[str, GuardedTool]
    settings: RunSettings | None = None  # what each compensation keeps (None: the boundary's current)

    async def compensate(
        self, principal: str, session: str, keys: list[str] | None, reason: str | None
    ) -> dict[str, Any]:
        forwards = await self._forwards(principal, session, keys)
        if not forwards:
            return {"state": "NOTHING_TO_DO", "session": session, "compensations": []}
        entries = [await self._undo(op, reason) for op in forwards]
        done = all(entry["state"] == State.COMPENSATED.value for entry in entries)
        return {"state": "COMPLETED" if done else "PARTIAL", "session": session, "compensations": entries}

    async def _forwards(self, principal: str, session: str, keys: list[str] | None) -> list[Operation]:
        """The session's compensable operations, most recently completed first."""
        found = await self.ledger.find(OperationFilter(principal, session=session, limit=_SESSION_SCAN_LIMIT))
        compensable = [
            op
            for op in found
            if op.idempotency_class is IdempotencyClass.COMPENSABLE
            and not op.step.startswith("compensate:")
            and (keys is None or op.step in keys)
            and op.state in (State.SUCCEEDED, State.COMPENSATED, State.UNKNOWN)
        ]
        return sorted(
            compensable, key=lambda op: (op.completed_at or op.updated_at, op.created_at), reverse=True
        )

    async def _undo(self, forward: Operation, reason: str | None) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "idempotency_key": forward.step,
            "tool": forward.tool,
            "compensation_tool": None,
        }
        spec = self._spec(forward)
        if spec is not None:
            entry["compensation_tool"] = spec.tool
        if forward.state is State.COMPENSATED:
            return {**entry, "state": State.COMPENSATED.value, "compensated_earlier": True}
        if forward.state is State.UNKNOWN:
            return {**entry, "state": State.UNKNOWN.value, "reason": _UNKNOWN_FORWARD}
        if spec is None or spec.tool not in self.tools:
            return {
                **entry,
                "state": forward.state.value,
                "reason": "no compensating tool is declared for it",
            }
        answer = await self._run(forward, spec, reason)
        entry["compensation_operation_id"] = answer.operation.operation_id if answer.operation else None
        if answer.error is not None:
            state = answer.operation.state.value if answer.operation else forward.state.value
            return {**entry, "state": state, "reason": f"[{answer.error.code.value}] {answer.error.message}"}
        marked = await self._mark(forward, answer, reason)
        return {**entry, "state": marked.state.value}

    def _spec(self, forward: Operation) -> CompensateSpec | None:
        tool = self.tools.get(forward.tool)
        return tool.policy.compensate if tool is not None else None

    async def _run(self, forward: Operation, spec: CompensateSpec, reason: str | None) -> Answer:
        target = self.tools[spec.tool]
        result = forward.result.structured if forward.result else None
        try:
            arguments = render_arguments(spec.arguments, forward.arguments, result)
            validated = _validate(target, arguments)
        except Exception as exc:  # a template or schema mismatch: reported, never raised
            return Answer(
                None, None, False, errors.invalid_arguments(f"compensation of {forward.step}: {exc}")
            )
        request = CallRequest(
            target,
            validated,
            compensation_key(forward),
            forward.session,
            forward.principal,
            settings=self.settings,
        )
        return await self.boundary.call(request)

    async def _mark(self, forward: Operation, answer: Answer, reason: str | None) -> Operation:
        detail = {"compensation_operation_id": answer.operation.operation_id if answer.operation else None}
        if reason:
            detail["reason"] = reason
        change = Transition(
            State.COMPENSATED,
            frozenset({State.SUCCEEDED}),
            AuditEvent.COMPENSATED,
            actor=Actor.principal(forward.principal),
            detail=detail,
        )
        marked = await self.ledger.update(forward.operation_id, change, self.boundary.clock())
        if marked is not None:
            return marked
        return await self.ledger.get_by_id(forward.principal, forward.operation_id) or forward


_UNKNOWN_FORWARD = (
    "its own outcome is unknown, so there is nothing known to undo yet: reconcile it (get_operation_status) "
    "or have a person resolve it (commitgate ops resolve), then compensate again"
)


def _validate(tool: GuardedTool, arguments: Any) -> dict[str, Any]:
    validate = getattr(tool.source, "validate", None)
    if not isinstance(arguments, dict):
        raise ValueError("compensation arguments must be an object")
    return dict(validate(arguments)) if validate else arguments
