"""`commitgate ops list|show|approve|deny|resolve|purge|budgets|migrate` and `commitgate stats`: operating the ledger.

These commands read and write the ledger directly (no server needs to run):
the ledger is the system of record of what commitgate did. `resolve` is how a
person closes an `UNKNOWN` operation after checking the downstream system;
it is recorded in the audit trail with who and why, and a later retry of the
same key replays the resolution. `approve` and `deny` decide an operation awaiting a person's
approval, through the same function every other way of deciding uses (core/approvals.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from commitgate.server.cli import evidence
from commitgate.server.cli.deciders import NotAnOperator, Operators
from commitgate.server.cli.evidence import add_evidence_arguments, evidence_of
from commitgate.server.cli.ledgers import ledger_choice, say_ledger
from commitgate.server.cli.served import policy_path
from commitgate.server.cli.shown import cell, console, json_text

if TYPE_CHECKING:  # rich is imported where a table is drawn: `--json` draws none
    from rich.table import Table
from commitgate.server.core import approvals, expiry
from commitgate.server.core.budgets import budget_report
from commitgate.server.core.resolutions import (
    Finding,
    Resolution,
    ResolutionError,
    current,
    note_for,
    resolve,
)
from commitgate.server.core.views import status_view
from commitgate.server.ledger import (
    Ledger,
    LedgerUnavailable,
    OperationFilter,
    open_ledger,
)
from commitgate.server.ledger.base import Counts, lease_over, owner_known_dead
from commitgate.server.ledger.evidence import Evidence
from commitgate.server.ledger.urls import Backend, parse_ledger_url
from commitgate.server.model.amounts import decimal_of, with_unit
from commitgate.server.model.audit import Actor, ActorRole, AuditEvent
from commitgate.server.model.durations import format_duration, parse_duration
from commitgate.server.model.facts import State
from commitgate.server.model.records import Operation, iso
from commitgate.server.policy.loading import default_policy, load_policy
from commitgate.server.policy.masking import mask_values, secret_values
from commitgate.server.policy.models import Policy
from commitgate.server.policy.problems import PolicyError
from commitgate.server.serve.evidence import attach

EXIT_STALE = 2
STALE_LIST_LIMIT = 1000


class CommandError(Exception):
    """A user-facing failure: printed to stderr, exit status 1."""


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


MAX_LIST_LIMIT = 100_000


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_LIST_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is out of range: use 1-{MAX_LIST_LIMIT}")
    return value


_BY = "(default: the OS user); an operator of the policy's [[auth.tokens]] when it has any, never an agent"


def add_where_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Which ledger a command works on, and how it answers."""
    parser.add_argument(
        "--policy",
        help="read the ledger URL from this policy (default: $COMMITGATE_POLICY, else the one Claude"
        " Desktop's commitgate entry serves)",
    )
    parser.add_argument("--ledger", help="ledger URL, e.g. sqlite:////var/lib/commitgate/ledger.db")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def add_ops_arguments(ops: argparse.ArgumentParser) -> None:
    where = add_where_arguments(argparse.ArgumentParser(add_help=False))
    actions = ops.add_subparsers(dest="action", required=True)

    listing = actions.add_parser("list", parents=[where], help="list operations, newest first")
    listing.add_argument("--state", type=str.upper, choices=[s.value for s in State])
    listing.add_argument("--tool")
    listing.add_argument("--session")
    listing.add_argument("--principal")
    listing.add_argument("--older-than", type=_duration, metavar="AGE", help="last changed at least AGE ago")
    listing.add_argument(
        "--limit", type=_limit, default=50, help=f"at most this many, 1-{MAX_LIST_LIMIT} (default: 50)"
    )
    listing.set_defaults(func=cmd_list)

    show = actions.add_parser(
        "show",
        parents=[where],
        help="one operation with its audit history (secret-looking values masked; --json shows them as recorded)",
    )
    show.add_argument("operation_id")
    show.set_defaults(func=cmd_show)

    resolve = actions.add_parser(
        "resolve", parents=[where], help="close an UNKNOWN operation after checking the system of record"
    )
    resolve.add_argument("operation_id")
    outcome = resolve.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--succeeded", action="store_true", help="it took effect (replays --result)")
    outcome.add_argument("--failed", action="store_true", help="it did not take effect")
    resolve.add_argument("--result", help="succeeded: the tool's result as JSON, replayed to later retries")
    resolve.add_argument(
        "--retryable",
        action="store_true",
        help="failed: it certainly did not happen, so the same key may run again (FAILED_RETRYABLE)",
    )
    resolve.add_argument("--reason", help="why (required with --failed); kept in the audit trail")
    resolve.add_argument("--by", help=f"who resolves it {_BY}")
    resolve.set_defaults(func=cmd_resolve)

    for verb, what in (("approve", "let it run"), ("deny", "refuse it: it never runs")):
        decide = actions.add_parser(
            verb, parents=[where], help=f"decide an operation AWAITING_APPROVAL: {what}"
        )
        decide.add_argument("operation_id")
        decide.add_argument(
            "--reason", required=verb == "deny", help="why; kept in the audit trail and shown to the agent"
        )
        decide.add_argument("--by", help=f"who decides {_BY}")
        decide.set_defaults(func=cmd_decide, decision=verb)

    purge = actions.add_parser("purge", parents=[where], help="delete records past their retention")
    purge.set_defaults(func=cmd_purge)

    budgets = actions.add_parser(
        "budgets",
        parents=[where],
        help="what each budget of the policy has spent, per scope, against its limit",
    )
    budgets.set_defaults(func=cmd_budgets)

    migrate = actions.add_parser(
        "migrate",
        parents=[where],
        help="bring a PostgreSQL ledger's schema up to date (safe to run concurrently)",
    )
    migrate.set_defaults(func=cmd_migrate)

    reads = add_evidence_arguments(actions, where)
    reads["verify"].set_defaults(func=cmd_verify)
    reads["export"].set_defaults(func=cmd_export)
    reads["notifications"].set_defaults(func=cmd_notifications)


def add_stats_arguments(stats: argparse.ArgumentParser) -> None:
    add_where_arguments(stats)
    stats.add_argument(
        "--unresolved-after",
        type=_duration,
        metavar="AGE",
        help="exit 2 listing UNKNOWN operations unresolved for longer than AGE (for cron and monitoring)",
    )
    stats.add_argument(
        "--metrics",
        metavar="URL",
        help="also read replays, conflicts, retries and reconciliations from a running server's /metrics",
    )
    stats.add_argument(
        "--token-env",
        metavar="NAME",
        help="environment variable holding the bearer token for --metrics (an operator's token:"
        ' role = "operator")',
    )
    stats.set_defaults(func=cmd_stats)


# --- plumbing ------------------------------------------------------------------------------


WHICH_LEDGER = "pass --policy FILE, the policy your server serves (or --ledger URL)"


def ledger_url(args: argparse.Namespace) -> str:
    """The ledger this command works on, said in one line on stderr."""
    path, served = (None, None) if args.ledger else policy_path(args)
    policy = load_policy(path) if path else default_policy()
    url, why = ledger_choice(args.ledger, policy, path)
    say_ledger(url, f"{why}, {served}" if served else why)
    return url


def policy_of(args: argparse.Namespace) -> Policy:
    """The policy a command needs beside the ledger: --policy, $COMMITGATE_POLICY, Claude Desktop's
    commitgate entry, or the bundled one."""
    path, _ = policy_path(args)
    return load_policy(path) if path else default_policy()


@asynccontextmanager
async def opened(
    url: str, *, must_exist: bool = True, evidence: Evidence | None = None
) -> AsyncIterator[Ledger | None]:
    """The ledger at `url`, to change it; None when it is a SQLite file that does not exist yet
    and `must_exist` is false (a file is never created, and another application's never migrated).
    `evidence`: the receipts and notifications its changes write, as a server's would."""
    try:
        where = parse_ledger_url(url)
    except ValueError as exc:
        raise CommandError(f"unsupported ledger URL {url!r}: {exc}") from None
    if where.backend is Backend.SQLITE and not where.sqlite_path.expanduser().exists():
        if must_exist:
            raise CommandError(f"no ledger at {url} (nothing has been recorded there); {WHICH_LEDGER}")
        yield None
        return
    ledger = await open_ledger(url)
    if evidence is not None:
        attach(ledger, evidence)
    try:
        yield ledger
    finally:
        await ledger.close()


@asynccontextmanager
async def reading(url: str) -> AsyncIterator[Ledger]:
    """The ledger at `url`, only to read: nothing is created or migrated; a missing, empty or foreign
    database is a LedgerUnavailable that says which."""
    ledger = await open_ledger(url, read_only=True)
    try:
        yield ledger
    finally:
        await ledger.close()


def _run(args: argparse.Namespace, body: Callable[[], Coroutine[Any, Any, int]]) -> int:
    try:
        return asyncio.run(body())
    except CommandError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except LedgerUnavailable as exc:
        told = (
            getattr(args, "ledger", None)
            or getattr(args, "policy", None)
            or os.environ.get("COMMITGATE_POLICY")
        )
        print(f"ledger: {exc}" + ("" if told else f"; {WHICH_LEDGER}"), file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"ledger: {exc}", file=sys.stderr)
        return 1


def _print_json(value: Any) -> None:
    print(json_text(value))


def ago(ts: float | None, now: float) -> str:
    if ts is None:
        return ""
    seconds = max(0.0, now - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def op_view(op: Operation, now: float, *, details: bool = False) -> dict[str, Any]:
    view = status_view(op, forwards_key=False, now=now)
    view.pop("retry_advice")  # advice depends on the serving policy; the ledger alone cannot tell
    view["principal"] = op.principal
    view["lease_expired"] = lease_over(op, now)
    if details:
        view["arguments"] = op.arguments
        view["completed_at"] = iso(op.completed_at)
    return view


def operations_table(ops: list[Operation], now: float, title: str) -> Table:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("operation", "tool", "state", "principal", "session", "key", "attempts", "changed"):
        table.add_column(column, overflow="fold")
    for op in ops:
        state = op.state.value + (" (lease expired)" if lease_over(op, now) else "")
        table.add_row(  # session, key and the rest may come from a client: shown literally
            cell(op.operation_id),
            cell(op.tool),
            state,
            cell(op.principal),
            cell(op.session),
            cell(op.step),
            str(op.attempts),
            ago(op.updated_at, now),
        )
    return table


# --- ops list / show ---------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    async def body() -> int:
        now = time.time()
        async with reading(ledger_url(args)) as ledger:
            older = now - args.older_than if args.older_than is not None else None
            state = State(args.state) if args.state else None
            where = OperationFilter(args.principal, args.session, state, args.tool, older, max(1, args.limit))
            ops = await ledger.find(where)
        ops = await _touched(args, ops, now)
        if args.json:
            _print_json({"operations": [op_view(op, now) for op in ops]})
        elif not ops:
            print("no operations match")
        else:
            console().print(operations_table(ops, now, f"{len(ops)} operation(s), newest first"))
        return 0

    return _run(args, body)


async def _touched(args: argparse.Namespace, ops: list[Operation], now: float) -> list[Operation]:
    """A listing is a touch, as the server's: a lapsed lease turns UNKNOWN and a wait for approval past
    its timeout expires, with the receipts a server writes. The ledger is opened to write only when one
    is due; where it cannot be written (read-only access), they are shown as found, a lapse marked."""
    if not any(expiry.due(op, now) for op in ops):
        return ops
    try:
        async with opened(ledger_url(args), evidence=evidence_of(args)) as ledger:
            assert ledger is not None  # it was just read
            return await expiry.touch_all(ledger, ops, now)
    except LedgerUnavailable:
        return ops


async def _get(ledger: Ledger, operation_id: str) -> Operation:
    op = await ledger.get_by_id(None, operation_id)
    if op is None:
        raise CommandError(f"no operation {operation_id} in the ledger (purged, or a typo?)")
    return op


def cmd_show(args: argparse.Namespace) -> int:
    async def body() -> int:
        now = time.time()
        async with reading(ledger_url(args)) as ledger:
            op = await _get(ledger, args.operation_id)
            history = await ledger.history(op.operation_id)
        view = op_view(op, now, details=True)
        view["history"] = [
            {
                "at": iso(entry.at),
                "event": entry.event,
                "from_state": entry.from_state,
                "to_state": entry.to_state,
                "attempt_fence": entry.fence,
                **_actor_fields(Actor.of_record(entry.actor, entry.event, op.principal)),
                "detail": entry.detail,
            }
            for entry in history
        ]
        if args.json:
            _print_json(view)
            return 0
        # On screen, as on the console: credentials hidden, card numbers cut to their last four
        # digits. --json keeps every value as recorded, for scripts.
        from rich.table import Table
        from rich.text import Text

        out = console()
        out.print(operations_table([op], now, f"operation {op.operation_id}"))
        secrets = secret_values(view)  # a credential in the arguments is hidden in the result's text too
        for key in (
            "idempotency_class", "arguments", "approval", "result", "error", "reconciliation", "expires_at",
        ):  # fmt: skip
            if view.get(key) is not None:
                shown = json_text(mask_values(view[key], secrets=secrets), indent=None)
                out.print(Text.assemble((key, "bold"), ": ", shown))
        table = Table(title="history", title_justify="left")
        for column in ("at", "event", "from", "to", "fence", "actor", "detail"):
            table.add_column(column, overflow="fold")
        for entry in view["history"]:
            detail = (
                json_text(mask_values(entry["detail"], secrets=secrets), indent=None)
                if entry["detail"]
                else ""
            )
            table.add_row(
                entry["at"],
                cell(entry["event"]),
                entry["from_state"] or "",
                entry["to_state"] or "",
                str(entry["attempt_fence"]),
                cell(Actor(ActorRole(entry["actor_role"]), entry["actor"]).shown),
                Text(detail),
            )
        out.print(table)
        return 0

    return _run(args, body)


def _actor_fields(actor: Actor) -> dict[str, str]:
    """Who made a transition, in `ops show --json`: the name and its role (principal, commitgate, operator)."""
    return {"actor": actor.name, "actor_role": actor.role.value}


# --- ops resolve ----------------------------------------------------------------------------------


def _resolution(args: argparse.Namespace, by: str) -> Resolution:
    if args.succeeded:
        if args.retryable:
            raise CommandError("--retryable goes with --failed")
        return Resolution(Finding.SUCCEEDED, by, args.reason, args.result)
    if args.result is not None:
        raise CommandError("--result goes with --succeeded")
    if not args.reason:
        raise CommandError("--failed needs --reason: say what you found in the system of record")
    return Resolution(Finding.FAILED_RETRYABLE if args.retryable else Finding.FAILED, by, args.reason)


def cmd_resolve(args: argparse.Namespace) -> int:
    async def body() -> int:
        operators = Operators.of(policy_of(args))
        now = time.time()
        async with opened(ledger_url(args), evidence=evidence_of(args)) as ledger:
            assert ledger is not None
            try:
                op = await current(ledger, args.operation_id, now)
                resolution = _resolution(args, _decider(operators, args.by, op))
                warning = note_for(op, resolution)
                resolved = await resolve(ledger, args.operation_id, resolution, now)
            except ResolutionError as exc:
                flag = f"--{exc.field}: " if exc.field else ""
                raise CommandError(flag + str(exc)) from None
        if warning is not None:
            print(f"note: {warning}", file=sys.stderr)
        if args.json:
            _print_json(op_view(resolved, now, details=True))
        else:
            print(f"{resolved.operation_id}: UNKNOWN -> {resolved.state.value} (by {resolution.by})")
        return 0

    return _run(args, body)


def _decider(operators: Operators, by: str | None, op: Operation) -> str:
    """The operator a decision on `op` is recorded as (cli/deciders.py says who may be)."""
    try:
        return operators.name_for(by, op.principal)
    except NotAnOperator as exc:
        raise CommandError(str(exc)) from None


# --- ops approve / deny ---------------------------------------------------------------------------


def cmd_decide(args: argparse.Namespace) -> int:
    """An operator's decision on an operation awaiting approval; the rules are core/approvals.py's."""

    async def body() -> int:
        operators = Operators.of(policy_of(args))
        now = time.time()
        async with opened(ledger_url(args), evidence=evidence_of(args)) as ledger:
            assert ledger is not None
            by = _decider(operators, args.by, await _get(ledger, args.operation_id))
            try:
                decided = await approvals.decide(
                    ledger,
                    args.operation_id,
                    args.decision,
                    by=by,
                    via="operator",
                    reason=args.reason,
                    now=now,
                )
            except approvals.ApprovalRefused as exc:
                raise CommandError(f"refused: {exc}") from None
        if args.json:
            _print_json(op_view(decided, now, details=True))
        else:
            after = (
                "it runs at the next call with its key"
                if decided.state is State.PENDING
                else "it will not run"
            )
            print(f"{decided.operation_id}: AWAITING_APPROVAL -> {decided.state.value} (by {by}); {after}")
        return 0

    return _run(args, body)


# --- ops verify, export and notifications: the evidence (cli/evidence.py) ------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    return _run(args, lambda: evidence.verify(args, None if args.source else ledger_url(args)))


def cmd_export(args: argparse.Namespace) -> int:
    return _run(args, lambda: evidence.export(args, ledger_url(args)))


def cmd_notifications(args: argparse.Namespace) -> int:
    return _run(args, lambda: evidence.notifications(args, ledger_url(args)))


# --- ops purge ------------------------------------------------------------------------------------


def cmd_purge(args: argparse.Namespace) -> int:
    async def body() -> int:
        async with opened(ledger_url(args), must_exist=False) as ledger:
            purged = 0 if ledger is None else await ledger.purge(time.time())
        if args.json:
            _print_json({"purged": purged})
        else:
            print(f"purged {purged} expired operation(s); UNKNOWN operations are never purged")
        return 0

    return _run(args, body)


# --- ops budgets ------------------------------------------------------------------------------------


def cmd_budgets(args: argparse.Namespace) -> int:
    async def body() -> int:
        policy = policy_of(args)
        now = time.time()
        if not policy.budgets:
            raise CommandError("the policy declares no budgets ([budgets.NAME]); nothing to show")
        async with reading(ledger_url(args)) as ledger:
            report = await budget_report(ledger, policy, now)
        if args.json:
            _print_json({"budgets": report})
        else:
            console().print(budgets_table(report))
        return 0

    return _run(args, body)


def budgets_table(report: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    table = Table(title="budgets: spent within the window, per scope", title_justify="left")
    for column in ("budget", "per", "scope", "spent", "limit", "left", "window", "operations", "tools"):
        table.add_column(
            column, overflow="fold", justify="right" if column in ("spent", "limit", "left") else "left"
        )
    for budget in report:
        tools = ", ".join(budget["tools"]) or "(no tool)"
        rows = budget["scopes"] or [
            {"scope": "(nothing spent)", "spent": 0, "left": budget["limit"], "operations": 0}
        ]
        unit = budget.get("unit")
        for row in rows:
            table.add_row(
                cell(budget["name"]),
                budget["per"],
                cell(row["scope"]),  # principals and sessions come from callers: shown literally
                cell(with_unit(decimal_of(row["spent"]), unit)),
                cell(with_unit(decimal_of(budget["limit"]), unit)),
                cell(with_unit(decimal_of(row["left"]), unit)),
                budget["window"],
                str(row["operations"]),
                cell(tools),
            )
    return table


# --- ops migrate ----------------------------------------------------------------------------------


async def _migrate(url: str) -> dict[str, Any]:
    """Apply pending PostgreSQL migrations; the report never holds the URL's password."""
    try:
        where = parse_ledger_url(url)
    except ValueError as exc:
        raise CommandError(f"unsupported ledger URL {url!r}: {exc}") from None
    if where.backend is Backend.SQLITE:
        note = "a SQLite ledger creates and migrates its schema itself when it is opened; nothing to do"
        return {"ledger": url, "backend": "sqlite", "applied": 0, "schema_version": None, "note": note}
    try:
        from commitgate.server.ledger.postgres import SCHEMA_VERSION, migrate, redact
    except ImportError as exc:
        raise CommandError(
            f"the PostgreSQL ledger needs asyncpg: pip install 'commitgate[postgres]' ({exc})"
        ) from None
    applied = await migrate(url)  # under an advisory lock: concurrent runs apply each migration once
    return {
        "ledger": redact(url),
        "backend": "postgresql",
        "applied": applied,
        "schema_version": SCHEMA_VERSION,
    }


def cmd_migrate(args: argparse.Namespace) -> int:
    async def body() -> int:
        report = await _migrate(ledger_url(args))
        if args.json:
            _print_json(report)
        elif report["backend"] == "sqlite":
            print(f"{report['ledger']}: {report['note']}")
        else:
            print(
                f"{report['ledger']}: applied {report['applied']} migration(s);"
                f" schema version {report['schema_version']}"
            )
        return 0

    return _run(args, body)


# --- stats ------------------------------------------------------------------------------------------

RETRY_EVENTS = (AuditEvent.RETRY, AuditEvent.RERUN_CLAIMED, AuditEvent.RETRY_CLAIMED)
RECONCILE_EVENTS = (
    AuditEvent.RECONCILED_FOUND,
    AuditEvent.RECONCILED_NOT_FOUND,
    AuditEvent.RECONCILE_UNDECIDED,
)


async def stale_operations(ledger: Ledger, cutoff: float, now: float) -> list[Operation]:
    """UNKNOWN since before `cutoff`, and RUNNING operations whose lease ran out before it."""
    unknown = await ledger.find(
        OperationFilter(None, state=State.UNKNOWN, older_than=cutoff, limit=STALE_LIST_LIMIT)
    )
    running = await ledger.find(OperationFilter(None, state=State.RUNNING, limit=STALE_LIST_LIMIT))
    orphaned = [op for op in running if lease_over(op, now) and _orphaned_since(op) <= cutoff]
    return sorted(unknown + orphaned, key=lambda op: op.updated_at)


def _orphaned_since(op: Operation) -> float:
    """When a RUNNING operation lost its owner: its last change if the owner is known dead, else its lease end."""
    if owner_known_dead(op.lease_owner) or op.lease_expires_at is None:
        return op.updated_at
    return op.lease_expires_at


def summarise(counts: Counts) -> dict[str, Any]:
    events = dict(sorted(counts.events.items()))
    return {
        "operations": {state.value: counts.states.get(state.value, 0) for state in State},
        "events": events,
        "retries": sum(events.get(e, 0) for e in RETRY_EVENTS),
        "reconciliations": sum(events.get(e, 0) for e in RECONCILE_EVENTS),
        "resolved_by_operator": events.get(AuditEvent.RESOLVED, 0),
        "not_in_ledger": "replays and conflicts write nothing to the ledger; count them from /metrics",
    }


def cmd_stats(args: argparse.Namespace) -> int:
    async def body() -> int:
        now = time.time()
        async with reading(ledger_url(args)) as ledger:
            counts = await ledger.counts()
            stale: list[Operation] = []
            if args.unresolved_after is not None:
                stale = await stale_operations(ledger, now - args.unresolved_after, now)
        summary = summarise(counts)
        if args.metrics:
            summary["since_server_start"] = await anyio.to_thread.run_sync(
                scrape_metrics, args.metrics, _token(args.token_env)
            )
        if args.unresolved_after is not None:
            summary["unresolved_after_seconds"] = args.unresolved_after
            summary["unresolved"] = [op_view(op, now) for op in stale]
        if args.json:
            _print_json(summary)
        else:
            _print_stats(summary, stale, now, args.unresolved_after)
        return EXIT_STALE if stale else 0

    return _run(args, body)


# Counters a server keeps in memory (not in the ledger): from its `/metrics`.
SERVER_COUNTERS = ("replays", "conflicts", "retries", "reconciliations", "lease_expiries", "attempts")


def _token(env: str | None) -> str | None:
    if env is None:
        return None
    token = os.environ.get(env)
    if not token:
        raise CommandError(f"--token-env {env}: that environment variable is not set")
    return token


def scrape_metrics(url: str, token: str | None) -> dict[str, float]:
    """Totals of the server's event counters since it started (summed over tools and classes)."""
    import httpx2
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        families = list(text_string_to_metric_families(_read_metrics_text(url, headers)))
    except httpx2.HTTPError as exc:
        raise CommandError(f"cannot read metrics from {url}: {exc}") from None
    except ValueError:  # the parser's: the answer is not Prometheus text
        raise CommandError(f"{url} did not answer Prometheus metrics: point --metrics at /metrics") from None
    totals: dict[str, float] = dict.fromkeys(SERVER_COUNTERS, 0.0)
    for family in families:
        name = family.name.removeprefix("commitgate_")
        if name in totals:
            totals[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


METRICS_DEADLINE = 10.0
METRICS_MAX_BYTES = 8 << 20


def _read_metrics_text(url: str, headers: dict[str, str]) -> str:
    """The body of a /metrics answer, within a deadline and a size cap: a stream (SSE) never ends."""
    import httpx2

    deadline = time.monotonic() + METRICS_DEADLINE
    with httpx2.stream("GET", url, headers=headers, timeout=METRICS_DEADLINE) as response:
        response.raise_for_status()
        kind = response.headers.get("content-type", "")
        if kind.startswith("text/event-stream"):
            raise CommandError(f"{url} is an event stream (the SSE endpoint?): point --metrics at /metrics")
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > METRICS_MAX_BYTES or time.monotonic() > deadline:
                raise CommandError(f"{url} did not answer like /metrics (too long or too slow)")
        return body.decode("utf-8", errors="replace")


def _print_stats(summary: dict[str, Any], stale: list[Operation], now: float, after: float | None) -> None:
    from rich.table import Table

    out = console()
    states = Table(title="operations by state", title_justify="left")
    states.add_column("state")
    states.add_column("count", justify="right")
    for state, n in summary["operations"].items():
        states.add_row(state, str(n))
    out.print(states)
    events = Table(title="audit events", title_justify="left")
    events.add_column("event")
    events.add_column("count", justify="right")
    for event, n in summary["events"].items():
        events.add_row(event, str(n))
    out.print(events)
    out.print(
        f"from the ledger: retries {summary['retries']} · reconciliations {summary['reconciliations']}"
        f" · resolved by an operator {summary['resolved_by_operator']}"
    )
    server = summary.get("since_server_start")
    if server is None:
        out.print(summary["not_in_ledger"] + " (pass --metrics URL)")
    else:
        out.print("since the server started: " + " · ".join(f"{k} {v:g}" for k, v in server.items()))
    if after is None:
        return
    if not stale:
        out.print(f"no operation unresolved for more than {format_duration(after)}")
        return
    title = f"{len(stale)} operation(s) unresolved for more than {format_duration(after)}: check, then `ops resolve`"
    out.print(operations_table(stale, now, title))
