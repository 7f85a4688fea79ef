"""`commitgate policy init --from-config FILE`: a policy that wraps the servers a client already runs.

Every server of the client config becomes an `[upstreams.NAME]`, every tool it lists a commented
`[tools.X]` whose class comes from the tool's own annotations, or from its name when it declares
nothing (docs/wrapping.md). Run again, it adds what is new and keeps every line already there; on a
config it rewrote before, the servers its commitgate entry serves are read from that entry's policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mcp.types as types

from commitgate.server.cli.client_configs import (
    ClientConfig,
    ClientConfigError,
    ServerEntry,
    bare,
    read_client_config,
    rewritten,
    shown,
    write_config,
)
from commitgate.server.cli.desktop import desktop_entry
from commitgate.server.cli.init_definitions import record_listings
from commitgate.server.cli.policy_writing import Block, check_written, composed
from commitgate.server.cli.safe_files import backup_slot, permissions, read_regular, refuse_link, replace_file
from commitgate.server.cli.tool_listing import Listing, list_all
from commitgate.server.cli.unwrap import read_policy_document, served_entries, serving_entry
from commitgate.server.model.durations import format_duration, parse_duration
from commitgate.server.policy.rules import RESERVED_TOOL_NAMES, TOOL_NAME
from commitgate.tools.hints import class_source, proposed_class, query_verb, write_word

DEFAULT_CONNECT_TIMEOUT = "60s"


def add_arguments(init: argparse.ArgumentParser) -> None:
    init.description = (
        "Connect to each server of an MCP client config, list its tools and write a policy serving them"
        " through commitgate, each with the class its annotations give; then print the client entry that"
        " replaces them."
    )
    init.add_argument(
        "--from-config",
        required=True,
        metavar="FILE",
        help="the client's config: claude_desktop_config.json, Cursor's mcp.json, VS Code's mcp.json or"
        " settings.json (comments and trailing commas allowed)",
    )
    init.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME",
        help="wrap only this server of the config (repeatable; default: every server)",
    )
    init.add_argument(
        "-o", "--output", metavar="OUT", help="policy file to write (default: commitgate.toml beside FILE)"
    )
    init.add_argument(
        "--force",
        action="store_true",
        help="write OUT anew, dropping its edits (default: keep every line of an existing OUT and add"
        " what is new)",
    )
    init.add_argument(
        "--write-config",
        action="store_true",
        help="also rewrite FILE: the wrapped servers replaced by one commitgate entry, the file before"
        " kept as FILE.bak (or FILE.bak.N) (default: only print the entry)",
    )
    init.add_argument(
        "--connect-timeout",
        type=parse_duration,
        default=parse_duration(DEFAULT_CONNECT_TIMEOUT),
        metavar="DURATION",
        help="how long each server may take to start and list its tools, e.g. 30s or 2m; `npx -y`"
        f" may be installing it (default: {DEFAULT_CONNECT_TIMEOUT})",
    )
    init.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    config = read_client_config(Path(args.from_config).expanduser())
    target = _target(config, args.output, args.force)
    if args.write_config:
        refuse_link(config.path)
        backup_slot(config.path, config.data)  # a link where the backup goes: refused before anything runs
    entries = _chosen(config, args.server, target)
    if not entries:
        print(f"commitgate: {config.path}: no server to wrap", file=sys.stderr)
        return 1
    listings = asyncio.run(list_all(entries, args.connect_timeout))
    if args.write_config:
        _unchanged(config)
    plan = plan_policy(config.path, target, listings, args.connect_timeout)
    if plan.text != target.text:
        mode = permissions(config.path) & 0o666
        if target.text is not None:
            mode &= permissions(target.out)  # never more readable than it was, nor than the config
        replace_file(target.out, plan.text.encode("utf-8"), mode)
    record_listings(target.out, listings)  # so serve advertises the real tools before they connect
    _report(config, target, listings, plan, args.write_config)
    for listing in listings:
        if listing.error is not None:
            print(f"commitgate: {listing.entry.name}: not reached: {listing.error}", file=sys.stderr)
    return 1 if any(listing.error for listing in listings) else 0


@dataclass(slots=True)
class Target:
    """The policy init writes, what is in it already, and the config's entry that serves it."""

    out: Path
    serving: ServerEntry | None  # the config's commitgate entry that serves OUT
    text: str | None  # OUT as it is; None: written anew
    document: dict[str, Any] = field(default_factory=dict)  # ... as read
    known: dict[str, ServerEntry] = field(default_factory=dict)  # the servers that entry serves


def _target(config: ClientConfig, output: str | None, force: bool) -> Target:
    default = config.path.parent / "commitgate.toml"
    if output:
        out = Path(output).expanduser()
        serving = serving_entry(config, out)
    else:
        serving = serving_entry(config, None) or serving_entry(config, default)
        out = serving.served_policy if serving and serving.served_policy else default
    refuse_link(out)
    text: str | None = None
    document: dict[str, Any] = {}
    if out.exists():
        try:
            text, document = read_policy_document(out)
        except ClientConfigError:
            if not force:
                raise
    known = served_entries(document, serving.raw_env) if serving is not None else {}
    if force:
        return Target(out, serving, None, {}, known)
    return Target(out, serving, text, document, known)


def _chosen(config: ClientConfig, names: list[str], target: Target) -> list[ServerEntry]:
    available = {**target.known, **{n: e for n, e in config.servers.items() if not e.runs_commitgate}}
    unknown = [name for name in names if name not in available and name not in config.servers]
    if unknown:
        raise ClientConfigError(
            f"{config.path}: no server {', '.join(map(shown, unknown))};"
            f" it has {', '.join(map(shown, available)) or 'none'}"
        )
    for name, entry in config.servers.items():
        if not entry.runs_commitgate or (names and name not in names):
            continue
        if target.serving is not None and name == target.serving.name:
            served = ", ".join(map(shown, target.known)) or "no server"
            print(f"{shown(name)} serves {target.out}: its servers ({served}) are read from there")
        else:
            print(f"commitgate: skipped {shown(name)}: it already runs commitgate", file=sys.stderr)
    return [entry for name, entry in available.items() if not names or name in names]


def _unchanged(config: ClientConfig) -> None:
    if read_regular(config.path) != config.data:
        raise ClientConfigError(
            f"{config.path} changed while init listed its servers' tools; nothing was written: run init again"
        )


# --- the policy ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Wrapped:
    """One upstream tool as the policy serves it."""

    name: str  # in the policy
    server: str
    tool: types.Tool

    @property
    def klass(self) -> str:
        return proposed_class(self.tool.annotations, self.tool.name)

    @property
    def from_name(self) -> bool:
        return class_source(self.tool.annotations, self.tool.name) == "name"


def served_pairs(tools: Mapping[str, Any]) -> dict[tuple[str, str], str]:
    """(upstream, upstream tool) -> the policy's entry, for the entries of a policy that serve one."""
    pairs = {}
    for name, raw in tools.items():
        if isinstance(raw, dict) and isinstance(raw.get("upstream"), str):
            pairs[(raw["upstream"], str(raw.get("upstream_tool", name)))] = name
    return pairs


def wrapped_tools(listings: list[Listing], tools: Mapping[str, Any] | None = None) -> list[Wrapped]:
    """The tools no entry of `tools` (the policy's) serves yet. Names that two servers share become
    `SERVER__TOOL` for both; reserved, unusable or already taken ones too."""
    served = served_pairs(tools or {})
    pairs = {*served, *((listing.entry.name, tool.name) for listing in listings for tool in listing.tools)}
    counts = Counter(tool for _, tool in pairs)
    taken = set(tools or {})
    wrapped = []
    for listing in listings:
        for tool in listing.tools:
            if (listing.entry.name, tool.name) in served:
                continue
            served[(listing.entry.name, tool.name)] = tool.name  # a tool listed twice is written once
            name = tool.name
            if (
                counts[name] > 1
                or name in RESERVED_TOOL_NAMES
                or not TOOL_NAME.fullmatch(name)
                or name in taken
            ):
                name = re.sub(r"[^A-Za-z0-9_.\-]", "_", f"{listing.entry.name}__{tool.name}")[:128]
            base, n = name, 1
            while name in taken:
                n += 1
                name = f"{base[:120]}_{n}"
            taken.add(name)
            wrapped.append(Wrapped(name, listing.entry.name, tool))
    return wrapped


@dataclass(frozen=True, slots=True)
class Plan:
    """The policy's text to write and what it adds."""

    text: str
    upstreams: list[str]  # added
    tools: list[Wrapped]  # added
    gone: list[tuple[str, str, str]]  # (upstream, tool, entry): served, no longer offered


def plan_policy(source: Path, target: Target, listings: list[Listing], connect_timeout: float) -> Plan:
    before = target.document if target.text is not None else {}
    upstreams = _table(before, "upstreams")
    tools = _table(before, "tools")
    new = [listing for listing in listings if listing.entry.name not in upstreams]
    items = wrapped_tools(listings, tools)
    blocks = [_upstream_block(listing, target.out, connect_timeout) for listing in new]
    blocks += [_tool_block(item) for item in items]
    text = composed(target.text, _header(source), blocks)
    check_written(text, before, blocks)
    offered = {(listing.entry.name, tool.name) for listing in listings for tool in listing.tools}
    reached = {listing.entry.name for listing in listings if listing.error is None}
    gone = [
        (upstream, tool, entry)
        for (upstream, tool), entry in served_pairs(tools).items()
        if upstream in reached and (upstream, tool) not in offered
    ]
    return Plan(text, [listing.entry.name for listing in new], items, gone)


def _table(document: dict[str, Any], key: str) -> dict[str, Any]:
    table = document.get(key)
    return table if isinstance(table, dict) else {}


def _header(source: Path) -> list[str]:
    return [
        f"Written by `commitgate policy init --from-config {source.resolve()}`.",
        "Each tool's class comes from what its server declares: readOnlyHint: true => safe-retry",
        "(retried freely); a tool that declares nothing and whose name reads as a query (get_..., list_...)",
        "=> safe-retry too, its comment says so; anything else => key-required (each call takes an",
        "idempotency_key; a repeat returns the first outcome). Change a class where you know the tool",
        "better: docs/wrapping.md. Running init again adds new servers and tools and keeps your edits.",
    ]


def _upstream_block(listing: Listing, out: Path, connect_timeout: float) -> Block:
    entry = listing.entry
    comments = []
    if listing.error is not None:
        comments += [
            f"{entry.name} could not be reached, so it has no [tools.X] entries yet: {listing.error[:300]}",
            'tools = "all" serves its tools once it starts, each with the class its annotations give;',
            f"`commitgate policy init` run again adds their entries (or `policy show --upstreams {out}`).",
        ]
    elif not listing.tools:
        comments.append(f"{entry.name} lists no tools.")
    variables = sorted({s.variable for s in entry.secrets.values()} | entry.environment)
    if variables:
        comments.append(f"Set {', '.join(variables)} where commitgate runs (in the client entry's env).")
    values: dict[str, Any] = {}
    if listing.error is not None:
        values["tools"] = "all"
    if connect_timeout != parse_duration(DEFAULT_CONNECT_TIMEOUT):
        values["connect_timeout"] = format_duration(connect_timeout)
    return Block("upstreams", entry.name, {**values, **_target_values(entry)}, comments)


def _target_values(entry: ServerEntry) -> dict[str, Any]:
    """How to start or reach the server: as the client config says, secrets as references."""
    if entry.command is not None:
        values: dict[str, Any] = {"command": entry.command}
        values |= {"args": entry.args} if entry.args else {}
        values |= {"env": entry.env} if entry.env else {}
        values |= {"cwd": entry.cwd} if entry.cwd else {}
        return values
    assert entry.url is not None
    values = {"url": entry.url}
    values |= {"transport": entry.transport} if entry.transport != "streamable-http" else {}
    values |= {"headers": entry.headers} if entry.headers else {}
    return values


def _tool_block(item: Wrapped) -> Block:
    annotations = item.tool.annotations
    declared = annotations.model_dump(by_alias=True, exclude_none=True) if annotations else {}
    said = ", ".join(f"{k}: {json.dumps(v, ensure_ascii=False)}" for k, v in declared.items())
    klass = item.klass
    verb, write = query_verb(item.tool.name), write_word(item.tool.name)
    if item.from_name and klass == "safe-retry":
        why = (
            f"its name reads as a query ({verb!r}) and its server declares nothing, so the class comes"
            " from the name: retried freely; make it key-required if it changes anything"
        )
    elif item.from_name:
        why = f"its name has {write!r}, so a repeat could repeat its effect; calls take an idempotency_key"
    elif klass == "safe-retry":
        why = "declared read-only, so it is retried freely"
    else:
        why = "not declared read-only, so a repeat could repeat its effect; calls take an idempotency_key"
    values = {"upstream": item.server}
    if item.name != item.tool.name:
        values["upstream_tool"] = item.tool.name
    values["class"] = klass
    comments = [f"{item.server} declares {said[:300] or 'no annotations'}.", f"{klass}: {why}."]
    return Block("tools", item.name, values, comments)


# --- what to do next ------------------------------------------------------------------------------------


def client_env(base: dict[str, str], listings: list[Listing], *, fill: bool) -> dict[str, str]:
    """The commitgate entry's env: `base` (an entry's own, as it is) and each variable the policy refers
    to, with its value as the config had it (`fill`) or a placeholder."""
    env = dict(base)
    for listing in listings:
        for secret in listing.entry.secrets.values():
            env.setdefault(secret.variable, secret.value if fill else f"<{secret.variable}>")
        for name in sorted(listing.entry.environment):
            env.setdefault(name, "${env:" + name + "}")  # the client passes it on as it did to the server
    return env


def client_entry(
    config: ClientConfig, out: Path, listings: list[Listing], serving: ServerEntry | None, *, fill: bool
) -> dict[str, Any]:
    """The entry that starts commitgate on `out` (the one already serving it, its env extended)."""
    if serving is not None:
        env = client_env(serving.raw_env, listings, fill=fill)
        return {**serving.raw, "env": env} if env or "env" in serving.raw else dict(serving.raw)
    entry = desktop_entry(str(out))
    if config.vscode:
        entry = {"type": "stdio", **entry}  # VS Code's form
    env = client_env({}, listings, fill=fill)
    return {**entry, "env": env} if env else entry


def entry_name(config: ClientConfig, wrapped: list[str]) -> str:
    """`commitgate`, unless another entry that stays already has that name."""
    name, n = "commitgate", 1
    while name in config.servers and name not in wrapped:
        n += 1
        name = f"commitgate-{n}"
    return name


def _rewrite(
    config: ClientConfig, target: Target, listings: list[Listing], wrapped: list[str], name: str
) -> None:
    entry = client_entry(config, target.out, listings, target.serving, fill=True)
    if target.serving is not None and not wrapped and entry == target.serving.raw:
        print(f"{config.path} stays as it is: its {shown(name)} entry serves {target.out} already.")
        return
    rewrite = write_config(config, rewritten(config, wrapped, name, entry))
    replaced = (
        f"{', '.join(map(shown, wrapped))} replaced by {shown(name)}" if wrapped else f"{shown(name)} updated"
    )
    kept = "kept" if rewrite.backed_up_now else "already kept"
    print(f"rewrote {config.path}: {replaced}; the file before is {kept} as {rewrite.backup}")
    _say_why_named(name, target)
    if rewrite.dropped_comments:
        table = ".".join(config.where)
        print(
            f"The comments inside its `{table}` were not kept (the rest of it was);"
            f" {rewrite.backup.name} has them."
        )
    print("Restart the client to use it.")


def _print_entry(
    config: ClientConfig, target: Target, listings: list[Listing], wrapped: list[str], name: str
) -> None:
    if target.serving is not None:
        added = {
            k: v
            for k, v in client_env(target.serving.raw_env, listings, fill=False).items()
            if k not in target.serving.raw_env
        }
        if not wrapped and not added:
            print(
                f"{config.path}: its {shown(name)} entry serves {target.out}; restart the client to use it."
            )
            return
        removed = (
            f"remove {', '.join(map(shown, wrapped))}, now served by {shown(name)}, and " if wrapped else ""
        )
        print(f"\nIn {config.path}, {removed}add to the env of {shown(name)} (or rerun with --write-config):")
        print(json.dumps(added, indent=2))
        return
    shown_entry = {config.where[-1]: {name: client_entry(config, target.out, listings, None, fill=False)}}
    print(
        f"\nIn {config.path}, replace {', '.join(map(shown, wrapped))} with this entry"
        " (or rerun with --write-config: init keeps the policy as it is and puts the entry there):"
    )
    print(json.dumps(shown_entry, indent=2))
    _say_why_named(name, target)


def _say_why_named(name: str, target: Target) -> None:
    if name != "commitgate" and target.serving is None:
        print(f"(It is called {name!r} because the entry 'commitgate' already in the config stays as it is.)")


def _report(
    config: ClientConfig, target: Target, listings: list[Listing], plan: Plan, write_config: bool
) -> None:
    out = target.out.resolve()
    reached = [listing for listing in listings if listing.error is None]
    if target.text is None:
        classes = Counter(item.klass for item in plan.tools)
        counted = ", ".join(f"{n} {klass}" for klass, n in sorted(classes.items()))
        print(
            f"wrote {out}: {len(reached)} of {len(listings)} servers reached, {len(plan.tools)} tools"
            f" ({counted or 'none'})"
        )
    else:
        _report_merge(out, plan)
    wrapped = [listing.entry.name for listing in listings if listing.entry.name in config.servers]
    name = target.serving.name if target.serving is not None else entry_name(config, wrapped)
    if write_config:
        _rewrite(config, target, listings, wrapped, name)
    else:
        _print_entry(config, target, listings, wrapped, name)
    secrets = [s for listing in listings for s in listing.entry.secrets.values()]
    variables = sorted({s.variable for s in secrets})
    if secrets and target.serving is None:
        names = ", ".join("${" + name + "}" for name in variables)
        how = (
            "the entry's env carries their values"
            if write_config
            else "fill in their values in the entry's env"
        )
        print(f"\nValues from the config stay out of the policy: it refers to {names}; {how}", end="")
        print(" (or set them in the environment commitgate starts in).")
    needed = sorted({*variables, *(name for listing in listings for name in listing.entry.environment)})
    first = (
        f" (with {', '.join(needed)} set in this shell: it reads them as the server will)" if needed else ""
    )
    print(
        f"Check the classes{first}: commitgate policy show {out}  (what each class means: docs/wrapping.md)"
    )
    _name_table(plan.tools)


def _report_merge(out: Path, plan: Plan) -> None:
    for upstream in plan.upstreams:
        print(f"added [upstreams.{bare(upstream)}]")
    for item in plan.tools:
        print(
            f"added [tools.{bare(item.name)}]: {shown(item.tool.name)} of {bare(item.server)}, {item.klass}"
        )
    for upstream, tool, entry in plan.gone:
        print(
            f"{bare(upstream)} no longer offers {shown(tool)}: [tools.{bare(entry)}] stays;"
            " remove it if it is gone for good"
        )
    if plan.upstreams or plan.tools:
        servers, tools = _count(len(plan.upstreams), "server"), _count(len(plan.tools), "tool")
        print(f"updated {out}: {servers} and {tools} added, every other line kept")
    else:
        print(f"{out}: nothing new; left as it was")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _name_table(items: list[Wrapped]) -> None:
    """Every class chosen from a tool's name, for the user to check."""
    rows = [(item.name, item.server, item.klass, _because(item)) for item in items if item.from_name]
    if not rows:
        return
    print("\nClasses chosen from tool names (their servers declare nothing; check them):")
    widths = [max(len(bare(row[i])) for row in rows) for i in range(3)]
    for row in rows:
        cells = [bare(row[i]).ljust(widths[i]) for i in range(3)]
        print(f"  {cells[0]}  {cells[1]}  {cells[2]}  {row[3]}")


def _because(item: Wrapped) -> str:
    write = write_word(item.tool.name)
    if write is not None:
        return f"its name has {write!r}"
    return f"its name starts with {query_verb(item.tool.name)!r}"
