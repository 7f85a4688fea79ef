"""`commitgate` commands. Nothing imports this module; it only wires arguments to the parts."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import faulthandler
import gc
import os
import sys
from pathlib import Path

from commitgate.server import __version__
from commitgate.server.cli.arguments import host_address, port_number
from commitgate.server.cli.commands import CommandParser
from commitgate.server.ledger.base import LedgerUnavailable
from commitgate.server.model.errors import UserFacingError
from commitgate.server.policy.loading import default_policy, load_policy
from commitgate.server.policy.models import Policy
from commitgate.server.policy.problems import PolicyError, Problem
from commitgate.tools.base import ToolBuildError

# At exit the interpreter's last collections walk every object of the process only to free memory
# the OS takes back anyway: 0.6 s of CPU for a server, which its client waits out before it can go on.
atexit.register(gc.freeze)


def _load(path: str | None) -> tuple[Policy, Path | None]:
    if path is None:
        return default_policy(), None
    return load_policy(path), Path(path).resolve()


def _configure_logging(level: str, unredacted: bool = False) -> None:
    from commitgate.server.serve.logs import configure_logging

    # stdout belongs to the MCP protocol under stdio: logs only ever go to stderr, as JSON lines.
    configure_logging(level, unredacted=unredacted)


def cmd_serve(args: argparse.Namespace) -> int:
    from commitgate.server.cli.ledgers import ledger_choice, log_ledger
    from commitgate.server.serve.gateway import Gateway
    from commitgate.server.serve.logs import log_event
    from commitgate.server.serve.surface import serve_stdio
    from commitgate.server.serve.tracing import configure_from_env, span_events

    _configure_logging(args.log_level, args.debug_unredacted)
    # A fatal signal (SIGBUS when the ledger's -shm file is truncated under SQLite's shared
    # memory, SIGSEGV in a native extension) would otherwise end the server without a word.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    policy, path = _load(args.policy or os.environ.get("COMMITGATE_POLICY"))
    policy.ledger.url, why = ledger_choice(args.ledger, policy, path)
    log_ledger(policy.ledger.url, why)

    async def run() -> None:
        gateway = await Gateway.open(policy, path, observers=[log_event, *span_events()])
        try:
            if args.transport == "stdio":
                await serve_stdio(gateway, __version__, args.stdio)
            else:
                from commitgate.server.serve.http import serve_http

                await serve_http(
                    gateway,
                    args.transport,
                    args.host,
                    args.port,
                    __version__,
                    stateless=args.stateless,
                    allowed_hosts=args.allowed_host,
                    announce=lambda url: print(
                        f"commitgate: serving MCP ({args.transport}) at {url}", flush=True
                    ),
                )
        finally:
            await gateway.close()

    stop_tracing = configure_from_env(__version__)  # only when OTEL_* variables ask for traces
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:  # SIGTERM: served calls were drained into the ledger; a clean stop
        return 0
    finally:
        stop_tracing()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from commitgate.server.demo.run import run_demo

    return asyncio.run(run_demo(quick=args.quick))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commitgate",
        description="An MCP server that puts a commit boundary between AI agents and the side effects of their tools.",
    )
    parser.add_argument("--version", action="version", version=f"commitgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    serve = sub.add_parser(
        "serve",
        help="serve the policy's tools over MCP",
        description="Serve the policy's tools over MCP. Over HTTP it prints the URL it serves on.",
    )
    serve.add_argument(
        "--transport",
        choices=["stdio", "sse", "streamable-http"],
        default="stdio",
        help="stdio for clients that start the server themselves (Claude Desktop); streamable-http"
        " (at /mcp) or sse (at /sse) to listen on a port (default: stdio)",
    )
    serve.add_argument(
        "--host",
        type=host_address,
        default="127.0.0.1",
        help="address to listen on over HTTP; a non-loopback one needs [[auth.tokens]] (default: 127.0.0.1)",
    )
    serve.add_argument(
        "--port",
        type=port_number,
        default=8765,
        help="TCP port to listen on over HTTP, 0-65535; 0 picks a free one (default: 8765)",
    )
    serve.add_argument(
        "--policy",
        help="policy file (default: $COMMITGATE_POLICY, else the bundled demo policy)",
    )
    serve.add_argument(
        "--ledger",
        help="ledger URL such as sqlite:////abs/path.db or postgresql://user@host/db, overriding"
        " [ledger] url (default: the policy's, else a file in your state directory)",
    )
    serve.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="least severe log lines written to stderr, as JSON (default: warning)",
    )
    serve.add_argument(
        "--stdio",
        choices=["fast", "sdk"],
        default="fast",
        help="stdio transport: a lean asyncio one or the MCP SDK's own; both behave the same on the"
        " wire (default: fast; the SDK's on Windows)",
    )
    serve.add_argument(
        "--stateless",
        action="store_true",
        help="streamable-http without sessions: any replica behind a load balancer can answer any"
        " request (default: off)",
    )
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a Host header to accept besides the loopback names, e.g. mcp.example.com (repeatable;"
        " default: none)",
    )
    serve.add_argument(
        "--debug-unredacted",
        action="store_true",
        help="let logs show argument values and error messages; never in production (default: off)",
    )
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="watch the guard work against a real server process")
    demo.add_argument(
        "--quick", action="store_true", help="a shorter run: fewer calls per step (default: off)"
    )
    demo.set_defaults(func=cmd_demo)
    for name, summary, arguments in _COMMANDS:
        sub.add_parser(name, help=summary, arguments=arguments)
    return parser


# The other commands: name, one-line help, and the function declaring its arguments, whose module is
# imported only when that command runs (start-up time matters: Claude Desktop starts `serve` often,
# and `--help` or a policy check should not import the server stack).
_COMMANDS = (
    ("policy", "check, show or describe a policy file", "commitgate.server.cli.policy:add_arguments"),
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
        "commitgate.tools.sandbox_api:add_arguments",
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
