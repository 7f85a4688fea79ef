"""`commitgate bench`: the safety experiments and the cost benchmark, through real processes.

This module is the command: its options, and the run of the chosen sections in one workspace.
The sections live beside it:

  * experiments.py: double charge, saga, backoff, concurrency, fresh keys (effects counted in
    the demo sandbox store, never in commitgate's own answers);
  * overhead.py: the time of a guarded, replayed and unguarded call beside a plain SDK server
    and the disk's floor, in paired rounds;
  * load.py: many sessions at once over streamable HTTP, guarded beside a plain SDK server;
  * ledger.py: the ledger alone (its throughput); memory.py: memory with a million ledger rows,
    ledger bytes per operation and start-up time; tracing.py: what tracing costs;
  * report.py: targets, safety checks, the table, the notes below it and the plot.

    commitgate bench [--quick] [--json FILE] [--plot FILE.png] [--only SECTION,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from commitgate.server.bench.experiments import backoff, concurrency, double_charge, fresh_keys, saga
from commitgate.server.bench.load import load
from commitgate.server.bench.memory import memory
from commitgate.server.bench.overhead import overhead
from commitgate.server.bench.report import checks, goals, missed_notes, plot, results_table
from commitgate.server.bench.tracing import tracing_cost
from commitgate.server.bench.workspace import FULL, QUICK, Bench, Scale

SECTIONS = (
    "double_charge",
    "saga",
    "backoff",
    "concurrency",
    "fresh_keys",
    "overhead",
    "ledger",
    "memory",
    "tracing",
    "load",
)


# --- the ledger alone: throughput ------------------------------------------------------------------------------------


async def ledger_alone(bench: Bench) -> dict[str, Any]:
    from commitgate.server.bench.ledger import run_ledger_bench

    tick = bench.task("ledger alone", 1)
    figures = await run_ledger_bench(bench.ledger("ledger-alone"), ops=bench.scale.ledger_ops, tasks=64)
    tick(1)
    return figures


# --- the run ---------------------------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Bench], Awaitable[dict[str, Any]]]] = {
    "double_charge": double_charge,
    "saga": saga,
    "backoff": backoff,
    "concurrency": concurrency,
    "fresh_keys": fresh_keys,
    "overhead": overhead,
    "ledger": ledger_alone,
    "memory": memory,
    "tracing": tracing_cost,
    "load": load,
}


@dataclass(frozen=True, slots=True)
class Options:
    quick: bool = False
    json_path: Path | None = None
    plot_path: Path | None = None
    only: tuple[str, ...] = SECTIONS
    seed: int = 7


async def run_bench(options: Options, console: Console | None = None) -> dict[str, Any]:
    """Run the chosen sections and return every figure (the same document `--json` writes)."""
    # Into a pipe or a file the table is 150 columns wide, unless COLUMNS says how wide to make it.
    console = console or Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 150)
    scale = QUICK if options.quick else FULL
    random.seed(options.seed)
    results: dict[str, Any] = {"meta": _meta(options, scale)}
    with tempfile.TemporaryDirectory(prefix="commitgate-bench-") as tmp:
        root = Path(tmp)
        columns = (
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with (root / "servers.log").open("w") as log, Progress(*columns, console=console) as progress:
            bench = Bench(root, scale, log, progress)
            try:
                for name in options.only:
                    results[name] = await RUNNERS[name](bench)
            except BaseException:
                log.flush()
                _show_log_tail(console, root / "servers.log")
                raise
        results["goals"] = goals(results)
        results["checks"] = checks(results)
        results["meta"]["seconds"] = round(time.perf_counter() - results["meta"].pop("_started"), 1)
        results["meta"]["cpu_stolen_share"] = stolen_share(
            results["meta"].pop("_cpu_at_start"), cpu_jiffies()
        )
        console.print(results_table(results))
        for line in missed_notes(results):
            console.print(line)
        if options.plot_path is not None:
            console.print(plot(results, bench.raw, options.plot_path))
    return results


def _meta(options: Options, scale: Scale) -> dict[str, Any]:
    return {
        "command": "commitgate bench" + (" --quick" if options.quick else ""),
        "quick": options.quick,
        "scale": asdict(scale),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "_cpu_at_start": cpu_jiffies(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "_started": time.perf_counter(),
    }


def cpu_jiffies(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(stolen, total) CPU time since boot in jiffies, from Linux's /proc/stat; None elsewhere.

    "Stolen" is time this virtual machine was ready to run but its host ran something else: on a
    shared VM it slows every figure of a run, and the load average does not show it.
    """
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    times = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return times[7], sum(times)


def stolen_share(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time its host took between two `cpu_jiffies` readings."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return round((end[0] - start[0]) / (end[1] - start[1]), 3)


def _show_log_tail(console: Console, path: Path, lines: int = 30) -> None:
    with contextlib.suppress(OSError):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        if tail:
            console.print("[bold]last lines of the servers' stderr:[/]")
            for line in tail:
                console.print(line, markup=False)


# --- command line ------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `commitgate bench`."""
    parser.add_argument("--quick", action="store_true", help="everything small (under a minute)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the figures (needs matplotlib)")
    parser.add_argument(
        "--only", metavar="SECTION,...", help=f"run only these sections, of: {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=7,
        help="random seed of the bench client, for repeatable runs (default: 7)",
    )
    parser.set_defaults(func=cmd_bench)


def options_from(args: argparse.Namespace) -> Options:
    only = SECTIONS
    if args.only:
        only = tuple(s.strip() for s in args.only.split(",") if s.strip())
        unknown = [s for s in only if s not in SECTIONS]
        if unknown:
            raise SystemExit(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    return Options(
        quick=args.quick,
        json_path=Path(args.json) if args.json else None,
        plot_path=Path(args.plot) if args.plot else None,
        only=only,
        seed=args.seed,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    options = options_from(args)
    results = asyncio.run(run_bench(options))
    if options.json_path is not None:
        options.json_path.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(results["checks"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commitgate bench")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
