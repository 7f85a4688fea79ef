"""Whether an edited policy weakens a guard of the running one (docs/policy.md#hot-reload).

A reload that only tightens (an approval added, a limit lowered, a tool removed) applies at once;
one that weakens any guard waits for a quiet file, so that a half-written file, valid TOML on its
own, never serves without the guard its full text keeps. `weakenings` names each weakened guard,
in the words of the file; an empty list means the edit may apply at once.

What cannot be compared (a changed CEL `when` or `amount`) counts as weaker: waiting two seconds
too many is cheap, one unguarded call is not.
"""

from __future__ import annotations

from collections.abc import Iterator

from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.policy.approvals import ApprovalPolicy
from commitgate.server.policy.budgets import BudgetPolicy
from commitgate.server.policy.duplicates import DuplicatesPolicy
from commitgate.server.policy.models import Policy, ToolPolicy
from commitgate.server.policy.problems import toml_key
from commitgate.server.policy.tokens import token_key

# Loosest last: a move to the right is weaker.
_PER = ("all", "principal", "session")
_DUPLICATE_ACTIONS = ("reject", "approval", "allow")
_DUPLICATE_SCOPES = ("principal", "session")


def weakenings(running: Policy, edited: Policy) -> list[str]:
    """Each guard `edited` holds weaker than `running`, said as `location: what changed`."""
    found = list(_tool_weakenings(running, edited))
    found += _budget_weakenings(running.budgets, edited.budgets)
    found += _token_weakenings(running, edited)
    return found


def _tool_weakenings(running: Policy, edited: Policy) -> Iterator[str]:
    for name, tool in edited.tools.items():
        where = f"tools.{toml_key(name)}"
        before = running.tools.get(name)
        if before is None:
            if tool.approval is None:
                yield f"{where}: a tool added without approval"
            continue
        if tool.expose and not before.expose and tool.approval is None:
            yield f"{where}.expose: a hidden tool listed to agents without approval"
        yield from _class_weakening(where, before, tool)
        yield from _approval_weakening(where, before.approval, tool.approval)
        yield from _duplicates_weakening(where, before.duplicates, tool.duplicates)
        if before.budget is not None and tool.budget != before.budget:
            yield f"{where}.budget: {before.budget!r} no longer counts its calls"


def _class_weakening(where: str, before: ToolPolicy, tool: ToolPolicy) -> Iterator[str]:
    if before.idempotency_class.keyed and tool.idempotency_class is IdempotencyClass.SAFE_RETRY:
        yield f"{where}.class: a keyed tool moved to safe-retry"
    elif before.idempotency_class is IdempotencyClass.KEY_AND_STATUS_CHECK and (
        tool.idempotency_class is not before.idempotency_class
    ):
        yield f"{where}.class: no status check any more for unknown outcomes"
    if tool.forwards_key and not before.forwards_key:
        yield f"{where}.forwards_key: ambiguous failures may now be retried"


def _approval_weakening(
    where: str, before: ApprovalPolicy | None, after: ApprovalPolicy | None
) -> Iterator[str]:
    if before is None:
        return
    if after is None:
        yield f"{where}.approval: removed"
        return
    if after.when.source != before.when.source and after.when.source.strip() != "true":
        yield f"{where}.approval.when: changed (which calls need approval cannot be compared)"
    widened = sorted(set(after.via) - set(before.via))
    if widened:
        yield f"{where}.approval.via: now also decided via {', '.join(widened)}"


def _duplicates_weakening(
    where: str, before: DuplicatesPolicy | None, after: DuplicatesPolicy | None
) -> Iterator[str]:
    if before is None:
        return
    if after is None:
        yield f"{where}.duplicates: turned off"
        return
    if _DUPLICATE_ACTIONS.index(after.action) > _DUPLICATE_ACTIONS.index(before.action):
        yield f"{where}.duplicates.action: {before.action} → {after.action}"
    if after.window < before.window:
        yield f"{where}.duplicates.window: shorter"
    if _DUPLICATE_SCOPES.index(after.scope) > _DUPLICATE_SCOPES.index(before.scope):
        yield f"{where}.duplicates.scope: {before.scope} → {after.scope}"


def _budget_weakenings(running: dict[str, BudgetPolicy], edited: dict[str, BudgetPolicy]) -> Iterator[str]:
    for name, before in running.items():
        where = f"budgets.{toml_key(name)}"
        after = edited.get(name)
        if after is None:
            yield f"{where}: removed"
            continue
        if after.limit > before.limit:
            yield f"{where}.limit: raised"
        if after.window < before.window:
            yield f"{where}.window: shorter"
        if _PER.index(after.per) > _PER.index(before.per):
            yield f"{where}.per: {before.per} → {after.per}"
        if before.exceeded == "reject" and after.exceeded != "reject":
            yield f"{where}.exceeded: calls past the limit may now be approved"
        if after.amount.source != before.amount.source:
            yield f"{where}.amount: changed (what a call spends cannot be compared)"


def _token_weakenings(running: Policy, edited: Policy) -> Iterator[str]:
    before = {token_key(t): t for t in (running.auth.tokens if running.auth else [])}
    for i, token in enumerate(edited.auth.tokens if edited.auth else []):
        where = f"auth.tokens[{i}]"
        old = before.get(token_key(token))
        if old is None:
            yield f"{where}: a token added"
        elif old.principal != token.principal:
            yield f"{where}.principal: the token now acts as {token.principal!r}"
        elif token.role == "operator" and old.role != "operator":
            yield f"{where}.role: now an operator's token"
        elif token.role == "operator" and _widened(old.sees, token.sees):
            yield f"{where}.principals: widened"


def _widened(before: frozenset[str] | None, after: frozenset[str] | None) -> bool:
    if after is None:
        return before is not None
    return before is not None and not after <= before
