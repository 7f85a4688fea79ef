"""*Check again*: the status check of a `key-and-status-check` operation, run from the console.

The same question the server asks when a retry or a poll meets an `UNKNOWN` operation
(docs/contract.md#operation-states): the tool's own status check, with the operation's arguments
and identity. Here a person decides what to make of it: a result found is offered in the
resolution form, and the answer is noted in the operation's reconciliation and audit history.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from commitgate.server.core import reconcile
from commitgate.server.core.requests import GuardedTool
from commitgate.server.ledger.base import Ledger, LedgerUnavailable
from commitgate.server.model.audit import Actor
from commitgate.server.model.errors import UserFacingError
from commitgate.server.model.events import BoundaryEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.notes import ReconciliationNote
from commitgate.server.model.outcomes import Verdict
from commitgate.server.model.records import Operation, ToolResult
from commitgate.server.policy.models import Policy
from commitgate.server.serve.registry import importable_beside_policy
from commitgate.tools.base import Collaborators, build_source
from commitgate.tools.http import pooled_client


class CheckUnavailable(UserFacingError):
    """The console cannot run this operation's status check; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Checked:
    verdict: Verdict
    note: ReconciliationNote  # as the server notes a status check's answer
    found: ToolResult | None = None

    def said(self) -> str:
        """The answer, for the person who asked."""
        if self.verdict is Verdict.FOUND:
            return (
                "The status check found it in the system of record: the result it found is filled in"
                " below, as the tool returned it; record it with “It took effect”."
            )
        if self.verdict is Verdict.NOT_FOUND:
            return "The status check found no trace of it: it did not take effect."
        return f"The status check could not tell: {self.note.error}"

    def result_json(self) -> str:
        """The found result as the resolution form takes it (empty when nothing was found)."""
        if self.found is None:
            return ""
        value = self.found.structured if self.found.structured is not None else self.found.content
        return json.dumps(value, indent=2, ensure_ascii=False)


async def check_again(op: Operation, policy: Policy | None, policy_dir: Path | None, at: float) -> Checked:
    """Ask the tool's status check about `op` once (CheckUnavailable when the console cannot): the
    server's own check (core/reconcile.py), with the tool source built here from the policy."""
    if policy is None or op.tool not in policy.tools:
        raise CheckUnavailable(
            f"the console's policy has no tool {op.tool!r}: start it with the --policy your server uses"
            " to run its status check from here"
        )
    if op.idempotency_class is not IdempotencyClass.KEY_AND_STATUS_CHECK or op.state is not State.UNKNOWN:
        raise CheckUnavailable(f"{op.operation_id} is not an UNKNOWN operation of a tool with a status check")
    tool = policy.tools[op.tool]
    if policy_dir is not None:
        importable_beside_policy(policy_dir)
    async with pooled_client() as http:
        try:
            source = build_source(op.tool, tool, policy, Collaborators(http=http))
        except Exception as exc:  # a source that cannot be built cannot tell either
            cannot = Verdict.CANNOT_TELL
            error = str(exc) or type(exc).__name__
            return Checked(cannot, ReconciliationNote("status_check", at, cannot.value, error=error))
        verdict, found, noted = await reconcile.status_check(
            GuardedTool(op.tool, tool, source), op, at, _unheard
        )
    return Checked(verdict, noted, found)


def _unheard(event: BoundaryEvent) -> None:
    """The console has no observers: the server's metrics count the server's checks."""


async def note(ledger: Ledger, op: Operation, checked: Checked, by: str, at: float) -> None:
    """The answer in the operation's reconciliation and audit history; the state stays UNKNOWN."""
    change = dataclasses.replace(
        reconcile.undecided(dataclasses.replace(checked.note, asked_by=by)), actor=Actor.operator(by)
    )
    try:
        await ledger.update(op.operation_id, change, at)
    except LedgerUnavailable as exc:
        raise CheckUnavailable(f"the answer could not be noted in the ledger: {exc}") from None
