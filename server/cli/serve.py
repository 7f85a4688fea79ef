"""`commitgate serve`: the policy's tools over MCP, on stdio or HTTP.

The policy is loaded and its ledger URL checked before the MCP server stack is imported: a policy
that does not load is reported in a fraction of the time, and a client such as Claude Desktop,
which starts the server itself, shows its user the reason sooner.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import sys
from pathlib import Path

from commitgate.server import __version__
from commitgate.server.cli.arguments import host_address, port_number
from commitgate.server.cli.ledgers import ledger_choice, log_ledger
from commitgate.server.ledger import ledger_location
from commitgate.server.policy.loading import default_policy, load_policy
from commitgate.server.policy.models import Policy
from commitgate.server.serve.logs import configure_logging


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.description = "Serve the policy's tools over MCP. Over HTTP it prints the URL it serves on."
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


def cmd_serve(args: argparse.Namespace) -> int:
    # stdout belongs to the MCP protocol under stdio: logs only ever go to stderr, as JSON lines.
    configure_logging(args.log_level, unredacted=args.debug_unredacted)
    # A fatal signal (SIGBUS when the ledger's -shm file is truncated under SQLite's shared
    # memory, SIGSEGV in a native extension) would otherwise end the server without a word.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    policy, path = _load(args.policy or os.environ.get("COMMITGATE_POLICY"))
    policy.ledger.url, why = ledger_choice(args.ledger, policy, path)
    log_ledger(policy.ledger.url, why)
    ledger_location(policy.ledger.url)  # a malformed URL is told before the server stack loads
    say_when_run_by_hand(args.transport)
    return serve(policy, path, args)


def say_when_run_by_hand(transport: str) -> None:
    """Run by hand in a terminal, a stdio server would otherwise wait in silence for a client."""
    if transport == "stdio" and sys.stdin.isatty():
        print(
            "commitgate: serving MCP on stdio, for a client that starts this command itself"
            " (`commitgate claude-config` prints its entry); Ctrl-C to stop.",
            file=sys.stderr,
        )


def _load(path: str | None) -> tuple[Policy, Path | None]:
    if path is None:
        return default_policy(), None
    return load_policy(path), Path(path).resolve()


def serve(policy: Policy, path: Path | None, args: argparse.Namespace) -> int:
    """Open the gateway over `policy` and serve it until stopped; the exit status."""
    # The server stack (the MCP SDK, the transports) is imported only once the policy has loaded.
    from commitgate.server.serve.gateway import Gateway
    from commitgate.server.serve.logs import log_event
    from commitgate.server.serve.surface import serve_stdio
    from commitgate.server.serve.tracing import configure_from_env, span_events

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
