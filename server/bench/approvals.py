"""What an approval check adds to a guarded call (a measurement, not a timed test).

    python -m commitgate.server.bench.approvals [--calls N] [--rounds R] [--json]

In one process, one commit boundary on a durable SQLite ledger (synchronous=FULL) serves the
same no-op tool four ways: `plain` and `same` (no approval; their difference is the noise),
`checked` (an `approval.when` that is false
for these calls: the CEL evaluation is all it adds) and `waits` (`when` true: the call is
recorded AWAITING_APPROVAL and answers approval_pending instead of running). Calls alternate
between the four, in a rotating order, with fresh keys; each round reports the median per
kind, and the figures are the medians over rounds of those medians and of the paired
differences.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from commitgate.server.core.boundary import CommitBoundary
from commitgate.server.core.requests import CallRequest
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve.registry import build_tools

POLICY = """
[server]
lease = "30s"

[tools.plain]
class = "key-required"
python = "commitgate.server.bench.tools:noop"
duplicates = false

[tools.same]
class = "key-required"
python = "commitgate.server.bench.tools:noop"
duplicates = false

[tools.checked]
class = "key-required"
python = "commitgate.server.bench.tools:noop"
duplicates = false
approval = { when = "arguments.n < 0 && principal != 'ops'" }

[tools.waits]
class = "key-required"
python = "commitgate.server.bench.tools:noop"
duplicates = false
approval = { when = "arguments.n >= 0" }
"""
KINDS = ("plain", "same", "checked", "waits")


async def measure(calls: int, rounds: int, directory: Path) -> dict[str, Any]:
    policy = loads_policy(POLICY)
    served = build_tools(policy, None)
    ledger = await SQLiteLedger.open(directory / "ledger.db")
    tools = {name: s.guard for name, s in served.items()}
    boundary = CommitBoundary(ledger, policy.server, tools)
    per_round: dict[str, list[float]] = {kind: [] for kind in KINDS}
    try:
        for warm in range(50):  # first calls pay imports, caches and the file's growth
            await _one(boundary, "plain", f"warm-{warm}", warm)
        for r in range(rounds):
            samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for i in range(calls):
                order = KINDS[i % len(KINDS) :] + KINDS[: i % len(KINDS)]
                for kind in order:
                    samples[kind].append(await _one(boundary, kind, f"r{r}-{i}", i))
            for kind in KINDS:
                per_round[kind].append(statistics.median(samples[kind]))
    finally:
        await ledger.close()
    return _figures(per_round, calls, rounds)


async def _one(boundary: CommitBoundary, kind: str, key: str, n: int) -> float:
    request = CallRequest(boundary.tools[kind], {"n": n}, f"{kind}-{key}", "bench", "bench")
    start = time.perf_counter()
    answer = await boundary.call(request)
    seconds = time.perf_counter() - start
    expected = "approval_pending" if kind == "waits" else None
    got = answer.error.code.value if answer.error is not None else None
    if got != expected:
        raise RuntimeError(f"{kind}: expected {expected}, got {got}")
    return seconds * 1e6


def _figures(per_round: dict[str, list[float]], calls: int, rounds: int) -> dict[str, Any]:
    def median(values: list[float]) -> float:
        return round(statistics.median(values), 1)

    plain, same, checked, waits = (per_round[k] for k in KINDS)
    return {
        "calls_per_round": calls,
        "rounds": rounds,
        "median_us": {kind: median(per_round[kind]) for kind in KINDS},
        "check_adds_us": median([c - p for c, p in zip(checked, plain, strict=True)]),
        "noise_us": median([s - p for s, p in zip(same, plain, strict=True)]),  # two identical tools
        "waiting_instead_of_running_us": median([w - p for w, p in zip(waits, plain, strict=True)]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commitgate.server.bench.approvals")
    parser.add_argument("--calls", type=int, default=300, help="calls of each kind per round (default 300)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="commitgate-bench-approvals-") as tmp:
        figures = asyncio.run(measure(args.calls, args.rounds, Path(tmp)))
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        m = figures["median_us"]
        print(f"median per guarded call over {args.rounds} rounds of {args.calls} calls each (µs):")
        print(f"  no approval            {m['plain']:>9.1f}")
        print(f"  no approval, again     {m['same']:>9.1f}   ({figures['noise_us']:+} µs paired: the noise)")
        print(f"  approval.when false    {m['checked']:>9.1f}   ({figures['check_adds_us']:+} µs paired)")
        print(f"  approval.when true     {m['waits']:>9.1f}   (recorded AWAITING_APPROVAL, not run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
