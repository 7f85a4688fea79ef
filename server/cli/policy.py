"""`commitgate policy check|show|schema`: validate, display and describe policy files."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from commitgate.server.cli.commands import CommandParser
from commitgate.server.cli.shown import console
from commitgate.server.model.amounts import with_unit
from commitgate.server.model.durations import format_duration
from commitgate.server.policy.loading import (
    default_policy,
    default_policy_text,
    load_policy,
    read_policy_file,
)
from commitgate.server.policy.masking import mask_secrets
from commitgate.server.policy.models import Policy, ToolPolicy, policy_json_schema
from commitgate.server.policy.problems import PolicyError
from commitgate.server.serve.checking import check_policy_file, format_report, policy_warnings


def add_arguments(policy: argparse.ArgumentParser) -> None:
    actions = policy.add_subparsers(dest="action", required=True, parser_class=CommandParser)

    check = actions.add_parser(
        "check", help="validate a policy file and print every problem with its location"
    )
    check.add_argument("file")
    check.add_argument("--json", action="store_true", help="print the problems as JSON")
    check.set_defaults(func=cmd_check)

    show = actions.add_parser("show", help="print the effective policy: each tool and how it is guarded")
    show.add_argument("file", nargs="?", help="default: $COMMITGATE_POLICY, else the bundled policy")
    show.add_argument("--json", action="store_true", help="the whole effective policy as JSON")
    show.add_argument(
        "--upstreams",
        action="store_true",
        help="also start/connect each upstream MCP server and list the tools it offers but the policy"
        " does not expose",
    )
    show.set_defaults(func=cmd_show)

    schema = actions.add_parser("schema", help="write the JSON Schema of policy files (editor completion)")
    schema.add_argument("-o", "--output", help="file to write (default: stdout)")
    schema.set_defaults(func=cmd_schema)
    actions.add_parser(
        "init",
        help="write a policy that wraps the servers of an MCP client config (Claude Desktop, Cursor, VS Code)",
        arguments="commitgate.server.cli.policy_init:add_arguments",
    )
    actions.add_parser(
        "unwrap",
        help="put the servers a client config's commitgate entry serves back into the config, as they were",
        arguments="commitgate.server.cli.unwrap:add_arguments",
    )


# --- check ----------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    problems = check_policy_file(Path(args.file))
    warnings = policy_warnings(Path(args.file))
    if args.json:
        problem_list = [p.as_json() for p in problems]
        print(
            json.dumps(
                {"file": args.file, "valid": not problems, "problems": problem_list, "warnings": warnings}
            )
        )
    else:
        print(format_report(args.file, problems))
        for warning in warnings:
            print(f"  warning: {warning}")
    return 1 if problems else 0


# --- schema ---------------------------------------------------------------------------


def schema_text() -> str:
    return json.dumps(policy_json_schema(), indent=2, ensure_ascii=False) + "\n"


def cmd_schema(args: argparse.Namespace) -> int:
    text = schema_text()
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}; point editors at it with a first line `#:schema ./{Path(args.output).name}`")
    return 0


# --- show -----------------------------------------------------------------------------


BUNDLED = "bundled default policy"


def effective_policy(file: str | None) -> tuple[Policy, str, dict[str, Any]]:
    """The policy `serve` would use, where it comes from, and its document before `${ENV}` resolution."""
    path = file or os.environ.get("COMMITGATE_POLICY")
    if path is None:
        return default_policy(), BUNDLED, tomllib.loads(default_policy_text())
    policy = load_policy(path)
    return policy, path, tomllib.loads(read_policy_file(path))


def keep_references(shown: Any, written: Any) -> Any:
    """Put `${ENV}` references back where the file has them: show never prints a resolved secret."""
    if isinstance(written, str) and "${" in written:
        return written
    if isinstance(shown, dict) and isinstance(written, dict):
        return {k: keep_references(v, written.get(k)) for k, v in shown.items()}
    if isinstance(shown, list) and isinstance(written, list) and len(shown) == len(written):
        return [keep_references(v, w) for v, w in zip(shown, written, strict=True)]
    return shown


def cmd_show(args: argparse.Namespace) -> int:
    from commitgate.server.ledger import default_ledger_url

    try:
        resolved, source, written = effective_policy(args.file)
    except PolicyError as exc:
        print(format_report(exc.source, exc.problems), file=sys.stderr)
        return 1
    policy_path = None if source == BUNDLED else source
    ledger = resolved.ledger.model_copy(
        update={"url": resolved.ledger.url or default_ledger_url(policy_path)}
    )
    resolved = resolved.model_copy(update={"ledger": ledger})
    shown = keep_references(resolved.model_dump(mode="json", by_alias=True, exclude_none=True), written)
    shown = mask_secrets(shown)  # a password or token written in the file is never printed
    inventory = upstream_inventory(resolved) if args.upstreams and resolved.upstreams else None
    if args.json:
        if inventory is not None:
            shown["upstream_inventory"] = [item.as_json() for item in inventory]
        print(json.dumps(shown, indent=2))
        return 0
    policy = Policy.model_construct(**{**dict(resolved), "tools": _display_tools(resolved, shown)})
    out = console()
    server = policy.server
    out.print(f"[bold]{source}[/bold]")
    out.print(
        f"server [bold]{server.name}[/bold] · ledger {shown['ledger']['url']} · default session"
        f" {server.session!r} · retention {format_duration(server.retention)} · respond within"
        f" {format_duration(server.respond_within)} · lease {format_duration(server.lease)}"
    )
    out.print(tools_table(policy))
    if policy.budgets:
        out.print(budgets_table(policy))
    if policy.upstreams:
        out.print(upstreams_table(shown["upstreams"], policy))
    if inventory is not None:
        out.print(inventory_table(inventory))
        for item in inventory:
            for warning in [*item.warnings, *(w for tool in item.tools for w in tool.warnings)]:
                out.print(f"[yellow]warning[/yellow]: upstream {escape(item.name)}: {escape(warning)}")
    return 0


def _display_tools(resolved: Policy, shown: dict[str, Any]) -> dict[str, ToolPolicy]:
    """Tools whose URLs show `${ENV}` references as written rather than resolved."""
    tools = {}
    for name, tool in resolved.tools.items():
        http = shown["tools"][name].get("http")
        if tool.http is not None and http is not None:
            tool = tool.model_copy(update={"http": tool.http.model_copy(update={"url": http["url"]})})
        tools[name] = tool
    return tools


def upstream_inventory(policy: Policy) -> list[Any]:
    """What each upstream offers against what the policy serves (connects once, then disconnects)."""
    from commitgate.tools.upstream import inventory

    return asyncio.run(inventory(policy))


def inventory_table(items: list[Any]) -> Table:
    table = Table(title="upstream tools", title_justify="left")
    for column in ("upstream", "connected", "exposed", "available, not exposed", "declared, not offered"):
        table.add_column(column, overflow="fold")
    for item in items:
        connected = "yes" if item.connected else f"no: {item.error}"
        table.add_row(
            item.name,
            connected,
            ", ".join(item.exposed),
            ", ".join(item.not_exposed),
            ", ".join(item.missing),
        )
    return table


def tools_table(policy: Policy) -> Table:
    table = Table(title="tools", title_justify="left")
    for column in ("tool", "class", "source", "key", "attempts", "retention", "compensation", "exposed"):
        table.add_column(column, overflow="fold", no_wrap=column in ("tool", "class", "key", "exposed"))
    for name, tool in policy.tools.items():
        table.add_row(
            name,
            tool.idempotency_class.value,
            _source(tool),
            _key(tool),
            _retries(tool),
            format_duration(policy.retention_for(name)) + _retention_note(policy, name),
            _compensation(tool),
            "yes" if tool.expose else "no",
        )
    return table


def _retention_note(policy: Policy, name: str) -> str:
    tool = policy.tools[name]
    own = tool.retention if tool.retention is not None else policy.server.retention
    if policy.retention_for(name) > own:
        return f" (the window of budget {tool.budget})"
    return "" if tool.retention is not None else " (default)"


def budgets_table(policy: Policy) -> Table:
    table = Table(title="budgets", title_justify="left")
    for column in ("budget", "amount", "limit", "window", "per", "when exceeded", "tools"):
        table.add_column(column, overflow="fold")
    for name, budget in policy.budgets.items():
        tools = [t for t, tool in policy.tools.items() if tool.budget == name]
        table.add_row(
            name,
            budget.amount.source,
            with_unit(budget.limit, budget.unit),
            format_duration(budget.window),
            budget.per,
            budget.exceeded,
            ", ".join(tools) or "none",
        )
    return table


def upstreams_table(written: dict[str, Any], policy: Policy) -> Table:
    table = Table(title="upstream MCP servers", title_justify="left")
    for column in ("name", "target", "tools served"):
        table.add_column(column, overflow="fold")
    for name, upstream in written.items():
        target = " ".join([upstream["command"], *upstream.get("args", [])]) if "command" in upstream else ""
        served = [t for t, tool in policy.tools.items() if tool.upstream == name]
        table.add_row(name, target or str(upstream.get("url")), ", ".join(served) or "none")
    return table


def _source(tool: ToolPolicy) -> str:
    text = f"{tool.source_kind}: {tool.source_ref}"
    check = tool.status_check
    if check is not None and check.python is not None:
        module, _, function = check.python.partition(":")
        same_module = tool.python is not None and tool.python.partition(":")[0] == module
        text += f"\nstatus check: {function if same_module else check.python}"
    elif check is not None and check.http is not None:
        text += f"\nstatus check: {check.http.method} {check.http.url}"
    return text


def _key(tool: ToolPolicy) -> str:
    if not tool.idempotency_class.keyed:
        return "no"
    return "required, forwarded" if tool.forwards_key else "required"


def _retries(tool: ToolPolicy) -> str:
    retry = tool.retry
    if retry.attempts == 1:
        return "none"
    return f"{retry.attempts} × {format_duration(retry.initial)}..{format_duration(retry.max)}"


def _compensation(tool: ToolPolicy) -> str:
    if tool.compensate is None:
        return ""
    arguments = "".join(f"\n  {k} = {_short(v)}" for k, v in tool.compensate.arguments.items())
    return f"{tool.compensate.tool}{arguments}"


def _short(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
