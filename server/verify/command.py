"""`commitgate verify TOOL --arguments JSON`: prove a write tool ready before an agent gets it.

Exit status: 0 every test passed, 1 a test failed, 2 verify could not run (one-line reason).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from commitgate.server.verify.effects import CouldNotRun
from commitgate.server.verify.run import Options, Report, verify

EXIT_PASSED, EXIT_FAILED, EXIT_COULD_NOT_RUN = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Runs a real server over the policy with a private temporary ledger and calls TOOL against its "
        "real target with faults injected at the boundary: an answer lost after success, a failure "
        "before the call, concurrent duplicates. Then checks the policy's claims about the tool "
        "(status check, forwards_key). This performs real effects."
    )
    parser.add_argument(
        "tool",
        metavar="TOOL",
        help='the tool\'s name as served: a policy entry, or a tool of a tools = "all" upstream',
    )
    parser.add_argument("--policy", help="policy file (default: the bundled demo policy)")
    parser.add_argument(
        "--arguments", required=True, metavar="JSON", help="the tool's arguments, a JSON object"
    )
    parser.add_argument(
        "--count",
        metavar="MODULE:FUNCTION",
        help="a function key -> number of effects in the system of record (else the status check, "
        "else invocations are counted)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, metavar="N", help="concurrent duplicates (default 8)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--yes", action="store_true", help="do not ask before performing real effects")
    parser.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    try:
        options = _options(args)
    except CouldNotRun as exc:
        return _could_not_run(str(exc), args.json)
    try:
        report = asyncio.run(verify(options, lambda: _confirmed(args, options)))
    except CouldNotRun as exc:
        return _could_not_run(str(exc), args.json)
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print_report(report)
    return EXIT_PASSED if report.passed else EXIT_FAILED


def _options(args: argparse.Namespace) -> Options:
    try:
        arguments = json.loads(args.arguments)
    except json.JSONDecodeError as exc:
        raise CouldNotRun(f"--arguments is not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise CouldNotRun("--arguments must be a JSON object, e.g. '{\"amount_cents\": 500}'")
    if args.concurrency < 2:
        raise CouldNotRun("--concurrency must be at least 2")
    policy = Path(args.policy) if args.policy else None
    if policy is not None and not policy.is_file():
        raise CouldNotRun(f"--policy {args.policy}: no such file")
    return Options(args.tool, arguments, policy, args.count, args.concurrency)


def _confirmed(args: argparse.Namespace, options: Options) -> bool:
    calls = 3 + options.concurrency
    print(
        f"commitgate verify calls {options.tool} for real, about {calls} times with 4 keys, against its real "
        "target: expect up to 4 real effects (more if the tool fails a test).",
        file=sys.stderr,
    )
    if args.yes or not sys.stdin.isatty():
        return True
    try:
        print("Proceed? [y/N] ", end="", file=sys.stderr, flush=True)  # stdout stays the report's
        return input().strip().lower() in ("y", "yes")
    except EOFError:
        return False


def _could_not_run(reason: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"verdict": "could_not_run", "reason": reason}))
    print(f"commitgate verify: could not run: {reason}", file=sys.stderr)
    return EXIT_COULD_NOT_RUN


def _print_report(report: Report) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{escape(report.tool)}[/] ({report.idempotency_class}) in {escape(report.policy)}")
    console.print(f"Counting: {escape(report.counting)}")
    table = Table(show_lines=False)
    for column in ("check", "verdict", "effects", "tool runs", "detail"):
        table.add_column(column)
    for check in report.checks:
        colour = {"pass": "green", "FAIL": "red", "skipped": "yellow"}[check.verdict]
        evidence = check.evidence
        table.add_row(
            escape(check.name),
            f"[{colour}]{check.verdict}[/]",
            evidence.describe() if evidence else "",
            str(evidence.invocations) if evidence else "",
            escape(check.detail),
        )
    console.print(table)
    verdict = "[green]ready: every test passed[/]" if report.passed else "[red]not ready: a test failed[/]"
    console.print(verdict)
