"""`commitgate` commands. Nothing imports this module; it only wires arguments to the parts."""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
from typing import TYPE_CHECKING

from commitgate.server import __version__
from commitgate.server.cli.commands import CommandParser

if TYPE_CHECKING:
    from commitgate.server.policy.problems import Problem

# At exit the interpreter's last collections walk every object of the process only to free memory
# the OS takes back anyway: 0.6 s of CPU for a server, which its client waits out before it can go on.
atexit.register(gc.freeze)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commitgate",
        description="An MCP server that puts a commit boundary between AI agents and the side effects of their tools.",
    )
    parser.add_argument("--version", action="version", version=f"commitgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, summary, arguments in _COMMANDS:
        sub.add_parser(name, help=summary, arguments=arguments)
    return parser


# Each command: its name, its one-line help, and the function declaring its arguments, whose module
# is imported only when that command runs (start-up time matters: Claude Desktop starts `serve`
# often, and `--help` or a policy check should not import the server stack).
_COMMANDS = (
    ("serve", "serve the policy's tools over MCP", "commitgate.server.cli.serve:add_arguments"),
    (
        "demo",
        "watch the guard work against a real server process",
        "commitgate.server.demo.run:add_arguments",
    ),
    (
        "policy",
        "a policy file: write one from a client config (init), check, show or describe it",
        "commitgate.server.cli.policy:add_arguments",
    ),
    (
        "ops",
        "list, show, approve, deny, resolve and purge operations in the ledger",
        "commitgate.server.cli.ops:add_ops_arguments",
    ),
    ("stats", "counts by state and event; stale unknowns", "commitgate.server.cli.ops:add_stats_arguments"),
    (
        "claude-config",
        "print the Claude Desktop entry that starts this installation, and where it goes",
        "commitgate.server.cli.desktop:add_arguments",
    ),
    (
        "bench",
        "measure safety (duplicate effects under faults) and cost (time per call) against real server"
        " processes",
        "commitgate.server.bench.run:add_arguments",
    ),
    (
        "sandbox",
        "run a Stripe-like payments API to wrap (loopback, SQLite)",
        "commitgate.server.demo.payments_api:add_arguments",
    ),
    (
        "verify",
        "run the three tests every write tool must pass (lost answer, failure before, duplicates)",
        "commitgate.server.verify.command:add_arguments",
    ),
    (
        "console",
        "a web page for operators: approvals to decide, unknown outcomes to resolve, operations to"
        " search, budgets to watch",
        "commitgate.server.console.command:add_arguments",
    ),
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The errors main reports are imported once a command is chosen: their modules bring the policy's
    # models and the ledger's records (pydantic and all), which `--help` and a mistyped command skip.
    from commitgate.server.ledger.base import LedgerUnavailable
    from commitgate.server.model.errors import UserFacingError
    from commitgate.server.policy.problems import PolicyError
    from commitgate.tools.base import ToolBuildError

    try:
        return int(args.func(args) or 0)
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
    except ToolBuildError as exc:
        where = getattr(args, "policy", None) or os.environ.get("COMMITGATE_POLICY") or "the bundled policy"
        print(f"commitgate: {where}: {len(exc.problems)} problem(s)", file=sys.stderr)
        print("\n".join(grouped(exc.problems)), file=sys.stderr)
    except LedgerUnavailable as exc:
        print(f"commitgate: ledger: {exc}", file=sys.stderr)
    except UserFacingError as exc:
        print(f"commitgate: {exc}", file=sys.stderr)
    except OSError as exc:  # the environment said no (a port in use, a directory given as a file, ...)
        print(f"commitgate: {describe_os_error(exc)}", file=sys.stderr)
    return 1


def grouped(problems: list[Problem]) -> list[str]:
    """One line per distinct message (a module that fails to import fails every tool it serves)."""
    places: dict[str, list[str]] = {}
    for problem in problems:
        places.setdefault(problem.message, []).append(problem.location)
    return [f"  {', '.join(where)}: {message}" for message, where in places.items()]


def describe_os_error(exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    return f"{reason}: {exc.filename}" if exc.filename else reason
