"""What this server adds to every ledger transaction: its signing key and its [[notify]] routes.

Built from the policy before the ledger opens, so a receipts key that cannot be used stops the start
(never a silently unsigned receipt).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import platformdirs

from commitgate.server.ledger.evidence import BudgetLine, Evidence, Evidenced, Route, Signer
from commitgate.server.policy.evidence import NotifyPolicy
from commitgate.server.policy.models import Policy

KEY_NAME = "receipts-key.pem"


def key_path(policy: Policy, policy_path: Path | None) -> tuple[Path, bool]:
    """Where the receipts key is, and whether it may be created there (only the default one)."""
    configured = policy.receipts.key_file
    if configured is None:
        return Path(platformdirs.user_state_path("commitgate")) / KEY_NAME, True
    path = Path(configured).expanduser()
    if not path.is_absolute() and policy_path is not None:
        path = policy_path.parent / path
    return path, False


def signer_for(policy: Policy, policy_path: Path | None) -> Signer:
    path, create = key_path(policy, policy_path)
    return Signer.load(path, create=create)


def target(entry: NotifyPolicy) -> str:
    """How the outbox names a [[notify]] entry: by its URL, so a reordered file keeps its events."""
    return hashlib.sha256(entry.url.encode()).hexdigest()[:16]


def routes_of(policy: Policy) -> list[Route]:
    return [
        Route(
            target(entry), frozenset(entry.events), frozenset(entry.principals) if entry.principals else None
        )
        for entry in policy.notify
    ]


def budgets_of(policy: Policy) -> dict[str, BudgetLine]:
    return {
        name: BudgetLine(budget.limit, budget.per, budget.window) for name, budget in policy.budgets.items()
    }


def evidence_for(policy: Policy, policy_path: Path | None) -> Evidence:
    signer = signer_for(policy, policy_path) if policy.receipts.enabled else None
    return Evidence(signer, routes_of(policy), budgets_of(policy))


def follow(evidence: Evidence, policy: Policy) -> None:
    """A reloaded policy's [[notify]] entries and budgets; the key stays until a restart."""
    evidence.retarget(routes_of(policy), budgets_of(policy))


def attach(ledger: object, evidence: Evidence) -> None:
    """Have `ledger` write `evidence` with every change from now on."""
    if evidence.active and hasattr(ledger, "attach"):
        ledger_with: Evidenced = ledger  # type: ignore[assignment]
        ledger_with.attach(evidence)
