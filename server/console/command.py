"""`commitgate console`: serve the operator's page on a port, over the ledger a policy names."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from commitgate.server.cli.arguments import host_address, port_number
from commitgate.server.cli.deciders import NotAnOperator, Operators
from commitgate.server.cli.ledgers import ledger_choice, say_ledger
from commitgate.server.cli.served import policy_path
from commitgate.server.ledger.urls import Backend, parse_ledger_url
from commitgate.server.model.errors import UserFacingError
from commitgate.server.policy.loading import default_policy, load_policy
from commitgate.server.policy.masking import mask_url
from commitgate.server.policy.models import Policy
from commitgate.server.policy.tokens import AuthConfigError, load_tokens

if TYPE_CHECKING:
    from commitgate.server.console.security import Access
    from commitgate.server.serve.oauth import OAuthVerifier

DEFAULT_PORT = 8766


def add_arguments(console: argparse.ArgumentParser) -> None:
    console.description = (
        "Serve the operator's console over the ledger, beside any running server. On loopback (the"
        " default) it prints a link with a one-time token; elsewhere it needs an operator's token in the"
        ' policy ([[auth.tokens]] with role = "operator").'
    )
    console.add_argument(
        "--policy",
        help="policy whose ledger, [[auth.tokens]], approval prompts and budgets to use"
        " (default: $COMMITGATE_POLICY, else the one Claude Desktop's commitgate entry serves)",
    )
    console.add_argument(
        "--ledger", help="ledger URL, overriding the policy's, e.g. sqlite:////var/lib/commitgate/ledger.db"
    )
    console.add_argument(
        "--host",
        type=host_address,
        default="127.0.0.1",
        help="address to listen on; a non-loopback one needs an operator's token in [[auth.tokens]]"
        " or an identity provider in [auth.oauth] (default: 127.0.0.1)",
    )
    console.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help=f"TCP port, 0 picks a free one (default: {DEFAULT_PORT})",
    )
    console.add_argument(
        "--as",
        dest="operator",
        metavar="NAME",
        help="the name the decisions taken through the printed loopback link are recorded under"
        " (default: the OS user); never a principal the policy gives an agent",
    )
    console.set_defaults(func=cmd_console)


def link_operator(name: str | None, policy: Policy) -> str:
    """Who the loopback link's decisions are recorded as: a person, never the agent they are about."""
    try:
        return Operators.of(policy).person(name, "--as")
    except NotAnOperator as exc:
        raise UserFacingError(str(exc)) from None


def console_oauth(policy: Policy) -> OAuthVerifier | None:
    """The checker of operators' access tokens, when `[auth.oauth]` says which audience they carry."""
    from commitgate.server.serve.oauth import OAuthVerifier

    oauth = policy.auth.oauth if policy.auth is not None else None
    if oauth is None:
        return None
    if oauth.audience is None and oauth.resource is None:
        print(
            "commitgate: [auth.oauth] names no `resource` (or `audience`): the console cannot tell which"
            " access tokens are meant for this server, so it takes none",
            file=sys.stderr,
        )
        return None
    return OAuthVerifier(oauth)


def _check_ledger_exists(url: str) -> None:
    """The console never creates a ledger: a typo would otherwise show an empty, reassuring page."""
    try:
        where = parse_ledger_url(url)
    except ValueError as exc:
        raise UserFacingError(f"unsupported ledger URL {mask_url(url)!r}: {exc}") from None
    if where.backend is Backend.SQLITE and not where.sqlite_path.expanduser().exists():
        raise UserFacingError(
            f"no ledger at {url} yet: start `commitgate serve` with the same policy first (it creates"
            " the ledger), or point --ledger / --policy at the one your server uses"
        )


def cmd_console(args: argparse.Namespace) -> int:
    # The web stack is imported only here: every other `commitgate` command builds this parser too.
    import uvicorn

    from commitgate.server.console.app import create_app, ledger_opener
    from commitgate.server.console.security import Access, check_bind
    from commitgate.server.serve.evidence import evidence_for

    path, served = policy_path(args)
    policy = load_policy(path) if path else default_policy()
    url, why = ledger_choice(args.ledger, policy, path)
    say_ledger(url, f"{why}, {served}" if served and not args.ledger else why)
    try:
        tokens = load_tokens(policy.auth)
    except AuthConfigError as exc:
        raise UserFacingError(str(exc)) from None
    oauth = console_oauth(policy)
    check_bind(args.host, tokens, oauth)
    operator = link_operator(args.operator, policy)
    _check_ledger_exists(url)
    asyncio.run(_check_ledger_is_ours(url))
    sock = _listen(args.host, args.port)
    access = Access.for_bind(args.host, sock.getsockname()[1], tokens, operator, oauth)
    _print_sign_in(sock, access)
    # Its decisions and resolutions write receipts and notifications as a server's changes do.
    evidence = evidence_for(policy, Path(path).resolve() if path else None)
    app = create_app(
        ledger_opener(url, evidence),
        access,
        policy=prompt_policy(policy, path, args.ledger),
        policy_dir=Path(path).expanduser().resolve().parent if path else None,
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    try:
        asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
    print("commitgate: console stopped", file=sys.stderr)
    return 0


async def _check_ledger_is_ours(url: str) -> None:
    """Refuse, before anything is printed, a database that is not a current commitgate ledger (or
    cannot be reached): the console opens the ledger without creating or migrating anything."""
    from commitgate.server.ledger import LedgerUnavailable, open_ledger

    try:
        ledger = await open_ledger(url, read_only=True)
    except LedgerUnavailable as exc:
        raise UserFacingError(f"ledger: {exc}") from None
    await ledger.close()


def _listen(host: str, port: int) -> socket.socket:
    from commitgate.server.serve.http import ServeRefused, listen

    try:
        return listen(host, port)
    except ServeRefused as refused:  # the same socket and words as `serve`; here a user mistake
        raise UserFacingError(str(refused.code).removeprefix("commitgate: ")) from None


def _print_sign_in(sock: socket.socket, access: Access) -> None:
    host, port = sock.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    if access.console_token is not None:
        link = f"http://{shown_host}:{port}/?token={access.console_token}"
        print(f"commitgate: console at {link}", flush=True)
        print(
            "commitgate: the link signs you in; anyone with it can approve, deny and resolve operations",
            flush=True,
        )
    else:
        print(f"commitgate: console at http://{shown_host}:{port}/", flush=True)
    if access.oauth is not None and access.oauth.policy.console_client_id is not None:
        print(
            f"commitgate: operators sign in through {access.oauth.policy.issuer} at"
            f" http://{shown_host}:{port}/oauth/login",
            flush=True,
        )
        return
    if access.console_token is None:
        print(
            "commitgate: sign in with ?token=YOUR_TOKEN (an operator's token of [[auth.tokens]]) or a"
            " bearer header",
            flush=True,
        )


def prompt_policy(policy: Policy, path: str | None, ledger_flag: str | None) -> Policy | None:
    """The policy whose approval prompts the page shows, if any.

    The bundled policy describes the demo's ledger only: beside `--ledger` alone its prompts would
    describe someone else's tools under the same names, so the page asks the generic question.
    """
    return policy if path or not ledger_flag else None
