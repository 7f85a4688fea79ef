"""`commitgate ops receipts|verify|export|notifications`: the evidence a ledger keeps, checked and shown.

`verify` needs nothing but the receipts (a ledger or an exported file) and, to trust who signed,
the public keys: it recomputes every hash, checks every signature and every chain link, and, given
a ledger, that each operation's stored arguments and result are the ones its receipts name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from commitgate.server.cli.shown import cell, console, json_text
from commitgate.server.ledger import open_ledger
from commitgate.server.ledger.evidence import Evidence, Evidenced
from commitgate.server.model.durations import parse_duration
from commitgate.server.model.receipts import FIELDS, Verdict, check_chains, ordered
from commitgate.server.model.records import iso
from commitgate.server.policy.loading import default_policy, load_policy
from commitgate.server.serve.evidence import evidence_for, signer_for


def add_evidence_arguments(
    actions: Any, where: argparse.ArgumentParser
) -> dict[str, argparse.ArgumentParser]:
    """The parsers of the commands that read a ledger, by name: `ops` gives them their plumbing."""
    receipts = actions.add_parser("receipts", parents=[where], help="this server's receipts key")
    receipts.add_argument(
        "--public-key",
        action="store_true",
        required=True,
        help="print the public key (hex) that checks its receipts",
    )
    receipts.set_defaults(func=cmd_receipts)

    verify = actions.add_parser(
        "verify", parents=[where], help="check every receipt chain, and the operations against their receipts"
    )
    verify.add_argument(
        "--from", dest="source", metavar="FILE.jsonl", help="check an export instead of a ledger"
    )
    verify.add_argument(
        "--public-key",
        action="append",
        metavar="KEY",
        help="a signer to trust: hex, or a file holding it (repeatable; default: any key, integrity only)",
    )

    export = actions.add_parser("export", parents=[where], help="write the receipts as JSON lines")
    export.add_argument(
        "--receipts", required=True, metavar="FILE.jsonl", help="where ('-': standard output)"
    )
    export.add_argument(
        "--since", metavar="T", help="only receipts from T on: a time (ISO 8601) or an age (24h)"
    )

    notifications = actions.add_parser(
        "notifications", parents=[where], help="notification deliveries still pending, and those given up"
    )
    return {"verify": verify, "export": export, "notifications": notifications}


def policy_path(args: argparse.Namespace) -> Path | None:
    path = args.policy or os.environ.get("COMMITGATE_POLICY")
    return Path(path).resolve() if path else None


def evidence_of(args: argparse.Namespace) -> Evidence:
    """What a command that changes the ledger writes with each change (as a server would)."""
    path = policy_path(args)
    return evidence_for(load_policy(path) if path else default_policy(), path)


# --- ops receipts --public-key ---------------------------------------------------------------------


def cmd_receipts(args: argparse.Namespace) -> int:
    path = policy_path(args)
    signer = signer_for(load_policy(path) if path else default_policy(), path)
    print(signer.public_hex)
    return 0


# --- ops verify ------------------------------------------------------------------------------------


def trusted_keys(values: list[str] | None) -> set[str] | None:
    if not values:
        return None
    keys = set()
    for value in values:
        text = value.strip().lower()
        if not _hex_key(text):
            try:
                text = Path(value).expanduser().read_text(encoding="utf-8").strip().lower()
            except OSError as exc:
                raise ValueError(
                    f"--public-key {value}: neither a key (64 hex digits) nor a readable file ({exc.strerror})"
                ) from None
            if not _hex_key(text):
                raise ValueError(f"--public-key {value}: the file does not hold a key (64 hex digits)")
        keys.add(text)
    return keys


def _hex_key(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def read_export(path: str) -> list[dict[str, Any]]:
    receipts = []
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"{path} line {number} is not a receipt (one JSON object a line)")
        receipts.append(value)
    return receipts


def stored_problem(
    receipts: Iterable[Mapping[str, Any]], stored: Mapping[str, tuple[str | None, str | None]]
) -> str | None:
    """The first operation whose stored arguments or result differ from what its receipts prove."""
    latest: dict[str, Mapping[str, Any]] = {}
    for receipt in receipts:
        operation_id = str(receipt["operation_id"])
        digests = stored.get(operation_id)
        if digests is None:  # purged after its retention: its receipts remain
            continue
        if receipt["arguments_sha256"] != digests[0]:
            return (
                f"operation {operation_id}: its stored arguments were edited (they differ from its receipts)"
            )
        before = latest.get(operation_id)
        if before is None or (receipt["at"], receipt["seq"]) >= (before["at"], before["seq"]):
            latest[operation_id] = receipt
    for operation_id, receipt in latest.items():
        if receipt["result_sha256"] != stored[operation_id][1]:
            return (
                f"operation {operation_id}: its stored result was edited (it differs from its last receipt)"
            )
    return None


@asynccontextmanager
async def reading(url: str) -> AsyncIterator[Evidenced]:
    ledger = await open_ledger(url, read_only=True)
    try:
        yield cast(Evidenced, ledger)
    finally:
        await ledger.close()


async def verify(args: argparse.Namespace, url: str | None) -> int:
    """`url` None: the export `--from` names."""
    trusted = trusted_keys(args.public_key)
    if url is None:
        receipts = read_export(args.source)
        if not receipts:
            return _fail(f"{args.source} holds no receipts: nothing to verify")
        verdict = check_chains(ordered(receipts), trusted, from_genesis=False)
        return _said(verdict, trusted, "")
    async with reading(url) as evidenced:
        receipts = await evidenced.receipts()
        if not receipts:
            return _fail(
                "this ledger holds no receipts (recorded before receipts were kept, with [receipts] enabled = false,"
                " or nothing recorded yet):"
                " nothing to verify"
            )
        verdict = check_chains(receipts, trusted)
        if verdict.whole:
            verdict.problem = stored_problem(receipts, await evidenced.stored_digests())
    return _said(verdict, trusted, " and every operation matches them")


def _said(verdict: Verdict, trusted: set[str] | None, more: str) -> int:
    if not verdict.whole:
        return _fail(f"verify failed: {verdict.problem}")
    who = (
        ""
        if trusted
        else " (signatures checked against the keys the receipts name: pass --public-key to trust)"
    )
    print(f"ok: {verdict.receipts} receipts in {verdict.chains} chain(s) are whole{more}{who}")
    return 0


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 1


# --- ops export --receipts -------------------------------------------------------------------------


def since_time(text: str | None, now: float) -> float | None:
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        pass
    try:
        return now - parse_duration(text)
    except ValueError:
        raise ValueError(f"--since {text}: give a time (2026-01-31T12:00:00Z) or an age (24h)") from None


async def export(args: argparse.Namespace, url: str) -> int:
    since = since_time(args.since, time.time())
    async with reading(url) as ledger:
        receipts = await ledger.receipts(since)
    lines = "".join(json.dumps({f: r[f] for f in FIELDS}, ensure_ascii=False) + "\n" for r in receipts)
    if args.receipts == "-":
        sys.stdout.write(lines)
    else:
        Path(args.receipts).expanduser().write_text(lines, encoding="utf-8")
        print(f"{len(receipts)} receipts written to {args.receipts}", file=sys.stderr)
    return 0


# --- ops notifications -----------------------------------------------------------------------------


async def notifications(args: argparse.Namespace, url: str) -> int:
    async with reading(url) as ledger:
        items = await ledger.undelivered()
    views = [
        {
            "event_id": item.event_id,
            "event": item.event,
            "operation_id": item.operation_id,
            "status": "failed" if item.failed_at is not None else "pending",
            "attempts": item.attempts,
            "at": iso(item.at),
            "next_at": None if item.failed_at is not None else iso(item.next_at),
            "last_error": item.last_error,
        }
        for item in items
    ]
    if args.json:
        print(json_text({"notifications": views}))
        return 0
    if not views:
        print("no notifications pending or failed")
        return 0
    from rich.table import Table  # only here: most commands that import this module draw no table

    table = Table(title="notifications not delivered")
    for column in ("event_id", "event", "operation_id", "status", "attempts", "next_at", "last_error"):
        table.add_column(column)
    for view in views:
        table.add_row(
            *(
                cell(None if view[c] is None else str(view[c]))
                for c in (
                    "event_id",
                    "event",
                    "operation_id",
                    "status",
                    "attempts",
                    "next_at",
                    "last_error",
                )
            )
        )
    console().print(table)
    return 0
