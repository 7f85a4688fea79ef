"""`commitgate` commands. Nothing imports this module; it only wires arguments to the parts."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import faulthandler
import gc
import importlib
import os
import sys
from pathlib import Path

from commitgate.server import __version__
from commitgate.server.cli.arguments import host_address, port_number
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


def build_parser(serving_only: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commitgate",
        description="An MCP server that puts a commit boundary between AI agents and the side effects of their tools.",
    )
    parser.add_argument("--version", action="version", version=f"commitgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

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
    if not serving_only:
        for module in _COMMAND_MODULES:
            importlib.import_module(module).register(sub)
    return parser


# Each of these adds its own subcommands; `serve` skips importing them (start-up time matters to
# clients such as Claude Desktop that start the server often).
_COMMAND_MODULES = (
    "commitgate.server.cli.policy",
    "commitgate.server.cli.ops",
    "commitgate.server.cli.desktop",
    "commitgate.server.bench.run",
    "commitgate.tools.sandbox_api",
    "commitgate.server.verify.command",
    "commitgate.server.console.command",
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(serving_only=argv[:1] == ["serve"]).parse_args(argv)
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
