"""Micro-benchmark of the ledger path every guarded call pays (not a timed test).

    python -m commitgate.server.bench.ledger [--ops N] [--tasks 64] [--ledger PATH|URL] [--json]

Four figures, each on the same durable ledger (synchronous=FULL unless told):
  * sequential claim + complete: one call at a time, the latency a lone agent sees;
  * dedup hit: a claim of an already SUCCEEDED key (what every replay costs);
  * duplicate lookup: sequential claim + complete with duplicate detection on and
    off, interleaved call by call: what the lookup inside the claim adds;
  * concurrent claim + complete: `tasks` asyncio tasks sharing one ledger, the
    throughput group commit buys, with its p99 latency and mean batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from commitgate.server.ledger import open_ledger
from commitgate.server.ledger.base import ClaimKind, ClaimRequest, DuplicateCheck, Ledger, Transition
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.audit import AuditEvent
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import ToolResult

_RESULT = ToolResult([{"type": "text", "text": '{"ok":true}'}], {"ok": True})
_ARGUMENTS = '{"amount_cents":500,"card":"4242"}'
_DECODED = json.loads(_ARGUMENTS)  # as the boundary passes them: decoded once, beside their text


_DETECTION = DuplicateCheck(window_seconds=600.0, any_session=False, reject=True)


def _request(session: str, step: str, detection: bool = False) -> ClaimRequest:
    # With detection on, each operation has arguments of its own (else all would be duplicates).
    fingerprint = hashlib.sha256(f"{session}/{step}".encode()).hexdigest() if detection else "f" * 64
    return ClaimRequest(
        principal="bench",
        session=session,
        step=step,
        tool="charge_card",
        idempotency_class=IdempotencyClass.KEY_REQUIRED,
        fingerprint=fingerprint,
        arguments_json=_ARGUMENTS,
        owner="bench:0:0",
        lease_seconds=30.0,
        retention_seconds=86400.0,
        duplicates=_DETECTION if detection else None,
        arguments=_DECODED,
    )


_SUCCEEDED = Transition(
    State.SUCCEEDED, frozenset({State.RUNNING}), AuditEvent.SUCCEEDED, expect_fence=1, result=_RESULT
)


async def claim_and_complete(ledger: Ledger, session: str, step: str, detection: bool = False) -> None:
    """What one first-time guarded call costs the ledger: a claim, then its outcome."""
    claim = await ledger.claim(_request(session, step, detection), time.time())
    if claim.kind is not ClaimKind.NEW:
        raise RuntimeError(f"benchmark key {step!r} was not new: {claim.kind}")
    now = time.time()  # as the boundary records an outcome: with the operation it holds
    if await ledger.update(claim.operation.operation_id, _SUCCEEDED, now, current=claim.operation) is None:
        raise RuntimeError(f"could not record the outcome of {step!r}")


async def dedup_hit(ledger: Ledger, session: str, step: str) -> None:
    claim = await ledger.claim(_request(session, step), time.time())
    if claim.kind is not ClaimKind.EXISTING or claim.operation.state is not State.SUCCEEDED:
        raise RuntimeError(f"expected a recorded success for {step!r}, got {claim.kind}")


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _latency_us(samples: list[float]) -> dict[str, float]:
    return {
        "median_us": round(statistics.median(samples) * 1e6, 1),
        "p99_us": round(_quantile(samples, 0.99) * 1e6, 1),
    }


async def _timed(
    operation: Callable[[Ledger, str, str], Awaitable[None]], ledger: Ledger, session: str, key: str
) -> float:
    start = time.perf_counter()
    await operation(ledger, session, key)
    return time.perf_counter() - start


async def _sequential(ledger: Ledger, ops: int) -> dict[str, float]:
    samples = [await _timed(claim_and_complete, ledger, "seq", f"k{i}") for i in range(ops)]
    return {"ops": ops, **_latency_us(samples)}


async def _dedup(ledger: Ledger, ops: int) -> dict[str, float]:
    keys = max(1, min(ops, 100))
    samples = [await _timed(dedup_hit, ledger, "seq", f"k{i % keys}") for i in range(ops)]
    return {"ops": ops, **_latency_us(samples)}


async def claim_and_complete_detecting(ledger: Ledger, session: str, step: str) -> None:
    await claim_and_complete(ledger, session, step, detection=True)


async def _lookup_cost(ledger: Ledger, ops: int) -> dict[str, float]:
    """Claim + complete with and without duplicate detection, alternating call by call."""
    off: list[float] = []
    on: list[float] = []
    for i in range(ops):
        off.append(await _timed(claim_and_complete, ledger, "lookup-off", f"k{i}"))
        on.append(await _timed(claim_and_complete_detecting, ledger, "lookup-on", f"k{i}"))
    added = [b - a for a, b in zip(off, on, strict=True)]
    return {
        "ops": ops,
        "off_median_us": round(statistics.median(off) * 1e6, 1),
        "on_median_us": round(statistics.median(on) * 1e6, 1),
        "added_median_us": round(statistics.median(added) * 1e6, 1),
    }


async def _concurrent(ledger: Ledger, ops: int, tasks: int) -> dict[str, float]:
    samples: list[float] = []
    per_task = max(1, ops // tasks)

    async def worker(t: int) -> None:
        for i in range(per_task):
            samples.append(await _timed(claim_and_complete, ledger, f"c{t}", f"k{i}"))

    before = _group_stats(ledger)
    start = time.perf_counter()
    await asyncio.gather(*(worker(t) for t in range(tasks)))
    elapsed = time.perf_counter() - start
    after = _group_stats(ledger)
    figures: dict[str, float] = {
        "tasks": tasks,
        "ops": len(samples),
        "seconds": round(elapsed, 3),
        "ops_per_s": round(len(samples) / elapsed, 1),
        "p99_us": round(_quantile(samples, 0.99) * 1e6, 1),
        "median_us": round(statistics.median(samples) * 1e6, 1),
    }
    if before is not None and after is not None and after[0] > before[0]:
        figures["mean_batch"] = round((after[1] - before[1]) / (after[0] - before[0]), 2)
    return figures


def _group_stats(ledger: Ledger) -> tuple[int, int] | None:
    return ledger.group_commit_stats if isinstance(ledger, SQLiteLedger) else None


async def run_ledger_bench(
    url_or_path: str | Path | None = None,
    *,
    ops: int = 2000,
    tasks: int = 64,
    synchronous: str = "FULL",
) -> dict[str, Any]:
    """Run the three measurements on a fresh ledger and return their figures.

    `url_or_path` is a ledger URL (`sqlite:///...`, `postgresql://...`) or a file path;
    None means a file in a temporary directory, removed afterwards. `ops` is the
    number of operations per measurement.
    """
    if url_or_path is None:
        with tempfile.TemporaryDirectory(prefix="commitgate-bench-") as tmp:
            return await run_ledger_bench(
                Path(tmp) / "ledger.db", ops=ops, tasks=tasks, synchronous=synchronous
            )
    url = str(url_or_path)
    if "://" not in url:
        url = f"sqlite:///{Path(url).resolve()}"
    ledger = await open_ledger(url, synchronous=synchronous)
    try:
        await claim_and_complete(ledger, "warmup", "k")
        return {
            "ledger": url,
            "synchronous": synchronous,
            "sequential_claim_complete": await _sequential(ledger, ops),
            "dedup_hit": await _dedup(ledger, ops),
            "duplicate_lookup": await _lookup_cost(ledger, ops),
            "concurrent_claim_complete": await _concurrent(ledger, ops, tasks),
        }
    finally:
        await ledger.close()


def _print_table(figures: dict[str, Any]) -> None:
    print(f"ledger: {figures['ledger']} (synchronous={figures['synchronous']})")
    seq, dedup, conc = (
        figures["sequential_claim_complete"],
        figures["dedup_hit"],
        figures["concurrent_claim_complete"],
    )
    print(f"sequential claim+complete  median {seq['median_us']:>8} µs   p99 {seq['p99_us']:>8} µs")
    print(f"dedup hit                  median {dedup['median_us']:>8} µs   p99 {dedup['p99_us']:>8} µs")
    lookup = figures["duplicate_lookup"]
    print(
        f"duplicate detection        median {lookup['on_median_us']:>8} µs vs {lookup['off_median_us']} µs off"
        f"   adds {lookup['added_median_us']} µs per claim+complete"
    )
    batch = f"   mean batch {conc['mean_batch']}" if "mean_batch" in conc else ""
    print(
        f"{conc['tasks']} tasks claim+complete   {conc['ops_per_s']:>10} ops/s   p99 {conc['p99_us']:>8} µs{batch}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commitgate.server.bench.ledger", description=__doc__)
    parser.add_argument("--ledger", help="ledger URL or file path (default: a temporary file)")
    parser.add_argument("--ops", type=int, default=5000, help="operations per measurement")
    parser.add_argument("--tasks", type=int, default=64, help="concurrent tasks")
    parser.add_argument("--synchronous", default="FULL", choices=["FULL", "NORMAL", "EXTRA", "OFF"])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = asyncio.run(
        run_ledger_bench(args.ledger, ops=args.ops, tasks=args.tasks, synchronous=args.synchronous)
    )
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
    else:
        _print_table(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
