"""What a budget check adds to a guarded call on SQLite (a benchmark, not a timed test).

    python -m commitgate.server.bench.budgets [--calls 300] [--rounds 5] [--prior 0,1000,10000] [--json]

Two keyed tools on one durable SQLite ledger (synchronous=FULL), alike but for a budget: the
same in-process commit boundary calls them alternately, call by call (the order swapped every
call), so both see the same disk, caches and machine load. Each call is a first-time guarded
call: evaluate the CEL amount (budgeted only), claim (with the sum of the scope's spending inside
the claim's transaction), run a tool that does nothing, record the outcome. Reported: the median
of each, and the median of the paired differences, per round; then the median over rounds.

The sum reads every operation of the scope within the window (through a covering index), so its
cost grows with what the scope spent recently: `--prior` fills each round's scope (a principal of
its own) with that many earlier operations before measuring; the round's own calls add to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from commitgate.server.core.boundary import CommitBoundary
from commitgate.server.core.budgets import Budget
from commitgate.server.core.requests import CallRequest, GuardedTool
from commitgate.server.ledger.base import BudgetCheck, ClaimRequest, Transition
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.canonical import canonical_json
from commitgate.server.model.context import OperationContext
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import ToolResult
from commitgate.server.policy.budgets import BudgetPolicy
from commitgate.server.policy.models import ServerPolicy, ToolPolicy

_RESULT = ToolResult([{"type": "text", "text": '{"ok":true}'}], {"ok": True})
_PRINCIPAL = "bench"


class _Nothing:
    """A tool that does nothing: what is measured is the guard around it."""

    description = "does nothing"
    input_schema: dict[str, Any] = {"type": "object"}  # noqa: RUF012
    output_schema: dict[str, Any] | None = None
    has_status_check = False

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return arguments

    async def call(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult:
        return _RESULT

    async def status(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        return None


def _tools() -> tuple[GuardedTool, GuardedTool]:
    policy = ToolPolicy.model_validate(
        {"class": "key-required", "python": "bench:nothing", "duplicates": False}
    )
    budget = BudgetPolicy.model_validate(
        {"amount": "arguments.amount_cents", "limit": 1e15, "window": "30d", "per": "principal"}
    )
    plain = GuardedTool("plain", policy, _Nothing())
    budgeted = GuardedTool(
        "budgeted", policy.model_copy(update={"budget": "bench"}), _Nothing(), Budget("bench", budget)
    )
    return plain, budgeted


async def _fill(ledger: SQLiteLedger, prior: int, principal: str) -> None:
    """`prior` succeeded operations of the budget in `principal`'s scope, claimed in batches."""
    check = BudgetCheck("bench", "principal", Decimal(500), Decimal(10**15), 30 * 86400.0)
    done = Transition(
        State.SUCCEEDED, frozenset({State.RUNNING}), AuditEvent.SUCCEEDED, expect_fence=1, result=_RESULT
    )

    async def one(i: int) -> None:
        request = ClaimRequest(
            principal=principal,
            session="prior",
            step=f"p{i}",
            tool="budgeted",
            idempotency_class=IdempotencyClass.KEY_REQUIRED,
            fingerprint=f"prior-{i}",
            arguments_json='{"amount_cents":500}',
            owner="bench:0:0",
            lease_seconds=30.0,
            retention_seconds=30 * 86400.0,
            budget=check,
        )
        claim = await ledger.claim(request, time.time())
        await ledger.update(claim.operation.operation_id, done, time.time(), current=claim.operation)

    for start in range(0, prior, 256):
        await asyncio.gather(*(one(i) for i in range(start, min(prior, start + 256))))


async def _timed(boundary: CommitBoundary, tool: GuardedTool, key: str, principal: str) -> float:
    arguments = {"amount_cents": 500, "n": key}
    request = CallRequest(tool, arguments, key, "measured", principal, canonical_json(arguments))
    start = time.perf_counter()
    answer = await boundary.call(request)
    elapsed = time.perf_counter() - start
    if answer.error is not None:
        raise RuntimeError(f"{tool.name} {key}: {answer.error.message}")
    return elapsed


async def _round(
    boundary: CommitBoundary, plain: GuardedTool, budgeted: GuardedTool, tag: str, calls: int
) -> dict[str, float]:
    """`calls` pairs, spending from the budget scope of principal `tag`."""
    off: list[float] = []
    on: list[float] = []
    for i in range(calls):
        pair = [(plain, off), (budgeted, on)]
        for tool, samples in pair if i % 2 == 0 else reversed(pair):
            samples.append(await _timed(boundary, tool, f"{tool.name}-{i}", tag))
    return {
        "plain_us": statistics.median(off) * 1e6,
        "budgeted_us": statistics.median(on) * 1e6,
        "added_us": statistics.median(b - a for a, b in zip(off, on, strict=True)) * 1e6,
    }


async def measure(prior: int, calls: int, rounds: int, root: Path) -> dict[str, Any]:
    ledger = await SQLiteLedger.open(root / f"budgets-{prior}.db", synchronous="FULL")
    try:
        for r in range(rounds):  # each round spends in a scope of its own, holding `prior` to start with
            await _fill(ledger, prior, f"{_PRINCIPAL}-{r}")
        plain, budgeted = _tools()
        settings = ServerPolicy.model_validate({})
        boundary = CommitBoundary(ledger, settings, {t.name: t for t in (plain, budgeted)})
        await _round(boundary, plain, budgeted, "warmup", 50)
        per_round = [
            await _round(boundary, plain, budgeted, f"{_PRINCIPAL}-{r}", calls) for r in range(rounds)
        ]
    finally:
        await ledger.close()

    def over_rounds(key: str) -> float:
        return round(statistics.median(r[key] for r in per_round), 1)

    return {
        "prior_operations_in_scope": prior,
        "calls_per_round": calls,
        "rounds": rounds,
        "plain_median_us": over_rounds("plain_us"),
        "budgeted_median_us": over_rounds("budgeted_us"),
        "added_median_us": over_rounds("added_us"),
        "added_per_round_us": [round(r["added_us"], 1) for r in per_round],
    }


async def run(priors: list[int], calls: int, rounds: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="commitgate-bench-budgets-") as tmp:
        return [await measure(prior, calls, rounds, Path(tmp)) for prior in priors]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commitgate.server.bench.budgets", description=__doc__)
    parser.add_argument("--calls", type=int, default=300, help="paired calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--prior", default="0,1000,10000", help="earlier operations in the scope, comma-separated"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    figures = asyncio.run(run([int(p) for p in args.prior.split(",")], args.calls, args.rounds))
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
        return 0
    print("guarded call on SQLite (FULL), median per round, then over rounds:")
    for f in figures:
        print(
            f"  {f['prior_operations_in_scope']:>6} earlier operations in scope: without budget "
            f"{f['plain_median_us']:>7} µs, with {f['budgeted_median_us']:>7} µs, "
            f"adds {f['added_median_us']} µs (rounds: {f['added_per_round_us']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
