"""`commitgate policy init --from-config FILE`: a policy that wraps the servers a client already runs.

Every server of the client config becomes an `[upstreams.NAME]`, every tool it lists a commented
`[tools.X]` whose class comes from the tool's own annotations (docs/wrapping.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mcp.types as types

from commitgate.server.cli.client_configs import (
    ClientConfig,
    ClientConfigError,
    ServerEntry,
    read_client_config,
    rewritten,
    write_with_backup,
)
from commitgate.server.cli.desktop import desktop_entry
from commitgate.server.cli.init_definitions import record_listings
from commitgate.server.cli.tool_listing import Listing, list_all
from commitgate.server.model.durations import format_duration, parse_duration
from commitgate.server.policy.rules import RESERVED_TOOL_NAMES, TOOL_NAME
from commitgate.tools.hints import proposed_class

DEFAULT_CONNECT_TIMEOUT = "60s"
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


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
    init.add_argument("--force", action="store_true", help="overwrite OUT if it exists (default: refuse)")
    init.add_argument(
        "--write-config",
        action="store_true",
        help="also rewrite FILE: the wrapped servers replaced by one commitgate entry, the original"
        " kept as FILE.bak (default: only print the entry)",
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
    out = Path(args.output).expanduser() if args.output else config.path.parent / "commitgate.toml"
    if out.exists() and not args.force:
        print(
            f"commitgate: {out} exists; give --force to overwrite it, or -o for another file", file=sys.stderr
        )
        return 1
    entries = _chosen(config, args.server)
    if not entries:
        print(f"commitgate: {config.path}: no server to wrap", file=sys.stderr)
        return 1
    listings = asyncio.run(list_all(entries, args.connect_timeout))
    text = policy_text(config.path, out, listings, args.connect_timeout)
    out.write_text(text, encoding="utf-8")
    record_listings(out, listings)  # so serve advertises the real tools before they connect
    _report(config, out.resolve(), listings, args.write_config)
    for listing in listings:
        if listing.error is not None:
            print(f"commitgate: {listing.entry.name}: not reached: {listing.error}", file=sys.stderr)
    return 1 if any(listing.error for listing in listings) else 0


def _chosen(config: ClientConfig, names: list[str]) -> list[ServerEntry]:
    unknown = [name for name in names if name not in config.servers]
    if unknown:
        raise ClientConfigError(
            f"{config.path}: no server {', '.join(map(repr, unknown))};"
            f" it has {', '.join(config.servers) or 'none'}"
        )
    entries = []
    for name, entry in config.servers.items():
        if names and name not in names:
            continue
        if entry.runs_commitgate:
            print(f"commitgate: skipped {name!r}: it already runs commitgate", file=sys.stderr)
            continue
        entries.append(entry)
    return entries


# --- the policy ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Wrapped:
    """One upstream tool as the policy serves it."""

    name: str  # in the policy
    server: str
    tool: types.Tool


def wrapped_tools(listings: list[Listing]) -> list[Wrapped]:
    """Names that two servers share become `SERVER__TOOL` for both; reserved or unusable ones too."""
    counts = Counter(tool.name for listing in listings for tool in listing.tools)
    wrapped = []
    for listing in listings:
        for tool in listing.tools:
            name = tool.name
            if counts[name] > 1 or name in RESERVED_TOOL_NAMES or not TOOL_NAME.fullmatch(name):
                name = re.sub(r"[^A-Za-z0-9_.\-]", "_", f"{listing.entry.name}__{tool.name}")[:128]
            wrapped.append(Wrapped(name, listing.entry.name, tool))
    return wrapped


def policy_text(source: Path, out: Path, listings: list[Listing], connect_timeout: float) -> str:
    lines = [
        f"# Written by `commitgate policy init --from-config {source.resolve()}`.",
        "# Each tool's class comes from what its server declares: readOnlyHint: true => safe-retry",
        "# (retried freely), anything else => key-required (each call takes an idempotency_key; a repeat",
        "# returns the first outcome). Change a class where you know the tool better: docs/wrapping.md.",
    ]
    secrets = [(listing.entry, s) for listing in listings for s in listing.entry.secrets.values()]
    if secrets:
        lines.append('# Set these where commitgate runs (e.g. the client entry\'s "env"):')
        lines += [f"#   {s.variable}: {s.where} of {entry.name}" for entry, s in secrets]
    for listing in listings:
        lines += ["", *_upstream_block(listing, out, connect_timeout)]
    for item in wrapped_tools(listings):
        lines += ["", *_tool_block(item)]
    return "\n".join(lines) + "\n"


def _upstream_block(listing: Listing, out: Path, connect_timeout: float) -> list[str]:
    entry = listing.entry
    lines = []
    if listing.error is not None:
        lines += [
            f"# {entry.name} could not be reached, so it has no [tools.X] entries yet: {listing.error}",
            '# tools = "all" serves its tools once it starts, each with the class its annotations give;',
            f"# `commitgate policy show --upstreams {out}` then lists them, to give them entries of their own.",
        ]
    elif not listing.tools:
        lines.append(f"# {entry.name} lists no tools.")
    lines.append(f"[upstreams.{toml_key(entry.name)}]")
    if listing.error is not None:
        lines.append('tools = "all"')
    if connect_timeout != parse_duration(DEFAULT_CONNECT_TIMEOUT):
        lines.append(f"connect_timeout = {toml_string(format_duration(connect_timeout))}")
    return lines + _target(entry)


def _target(entry: ServerEntry) -> list[str]:
    """How to start or reach the server: as the client config says, secrets as references."""
    values: list[tuple[str, str]]
    if entry.command is not None:
        values = [("command", toml_string(entry.command))]
        values += [("args", f"[{', '.join(map(toml_string, entry.args))}]")] if entry.args else []
        values += [("env", toml_table(entry.env))] if entry.env else []
        values += [("cwd", toml_string(entry.cwd))] if entry.cwd else []
    else:
        assert entry.url is not None
        values = [("url", toml_string(entry.url))]
        values += (
            [("transport", toml_string(entry.transport))] if entry.transport != "streamable-http" else []
        )
        values += [("headers", toml_table(entry.headers))] if entry.headers else []
    return [f"{key} = {value}" for key, value in values]


def _tool_block(item: Wrapped) -> list[str]:
    annotations = item.tool.annotations
    declared = annotations.model_dump(by_alias=True, exclude_none=True) if annotations else {}
    said = ", ".join(f"{k}: {json.dumps(v)}" for k, v in declared.items()) or "no annotations"
    klass = proposed_class(annotations)
    why = (
        "declared read-only, so it is retried freely"
        if klass == "safe-retry"
        else "not declared read-only, so a repeat could repeat its effect; calls take an idempotency_key"
    )
    lines = [f"# {item.server} declares {said}.", f"# {klass}: {why}."]
    lines.append(f"[tools.{toml_key(item.name)}]")
    lines.append(f"upstream = {toml_string(item.server)}")
    if item.name != item.tool.name:
        lines.append(f"upstream_tool = {toml_string(item.tool.name)}")
    lines.append(f"class = {toml_string(klass)}")
    return lines


def toml_string(value: str) -> str:
    # A JSON string is a TOML basic string, except for DEL, which TOML wants escaped.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_table(values: dict[str, str]) -> str:
    return "{ " + ", ".join(f"{toml_key(k)} = {toml_string(v)}" for k, v in values.items()) + " }"


# --- what to do next ------------------------------------------------------------------------------------


def client_entry(config: ClientConfig, out: Path, listings: list[Listing], *, fill: bool) -> dict[str, Any]:
    """The entry that starts commitgate on `out`; secrets as they were (`fill`) or as placeholders."""
    entry = desktop_entry(str(out))
    if config.where[-1] == "servers":
        entry = {"type": "stdio", **entry}  # VS Code's form
    env = {}
    for listing in listings:
        for secret in listing.entry.secrets.values():
            # The rewritten config keeps each value where it was already; a printed one is left to fill in.
            env[secret.variable] = secret.value if fill else f"<{secret.variable}>"
        for name in sorted(listing.entry.environment):
            env[name] = "${env:" + name + "}"  # the client passes it on as it did to the server
    return {**entry, "env": env} if env else entry


def entry_name(config: ClientConfig, wrapped: list[str]) -> str:
    """`commitgate`, unless another entry that stays already has that name."""
    name, n = "commitgate", 1
    while name in config.servers and name not in wrapped:
        n += 1
        name = f"commitgate-{n}"
    return name


def _rewrite(config: ClientConfig, out: Path, listings: list[Listing], wrapped: list[str], name: str) -> None:
    servers = rewritten(config, wrapped, name, client_entry(config, out, listings, fill=True))
    backup, dropped = write_with_backup(config, servers)
    print(f"rewrote {config.path}: {', '.join(wrapped)} replaced by {name!r}; the original is {backup}")
    _say_why_named(name)
    if dropped:
        table = ".".join(config.where)
        print(
            f"The comments inside its `{table}` were not kept (the rest of it was); {backup.name} has them."
        )
    print("Restart the client to use it.")


def _print_entry(
    config: ClientConfig, out: Path, listings: list[Listing], wrapped: list[str], name: str
) -> None:
    shown = {config.where[-1]: {name: client_entry(config, out, listings, fill=False)}}
    print(
        f"\nIn {config.path}, replace {', '.join(wrapped)} with this entry"
        " (or rerun with --write-config --force: init writes the policy again and puts the entry there):"
    )
    print(json.dumps(shown, indent=2))
    _say_why_named(name)


def _say_why_named(name: str) -> None:
    if name != "commitgate":
        print(f"(It is called {name!r} because the entry 'commitgate' already in the config stays as it is.)")


def _report(config: ClientConfig, out: Path, listings: list[Listing], write_config: bool) -> None:
    items = wrapped_tools(listings)
    classes = Counter(proposed_class(item.tool.annotations) for item in items)
    reached = [listing for listing in listings if listing.error is None]
    counted = ", ".join(f"{n} {klass}" for klass, n in sorted(classes.items()))
    print(
        f"wrote {out}: {len(reached)} of {len(listings)} servers reached, {len(items)} tools ({counted or 'none'})"
    )
    wrapped = [listing.entry.name for listing in listings]
    name = entry_name(config, wrapped)
    if write_config:
        _rewrite(config, out, listings, wrapped, name)
    else:
        _print_entry(config, out, listings, wrapped, name)
    secrets = [s for listing in listings for s in listing.entry.secrets.values()]
    variables = sorted({s.variable for s in secrets})
    if secrets:
        names = ", ".join("${" + name + "}" for name in variables)
        how = (
            "the entry's env carries their values"
            if write_config
            else "fill in their values in the entry's env"
        )
        print(f"\nSecrets stay out of the policy: it refers to {names}; {how}", end="")
        print(" (or set them in the environment commitgate starts in).")
    needed = sorted({*variables, *(name for listing in listings for name in listing.entry.environment)})
    first = (
        f" (with {', '.join(needed)} set in this shell: it reads them as the server will)" if needed else ""
    )
    print(
        f"Check the classes{first}: commitgate policy show {out}  (what each class means: docs/wrapping.md)"
    )
