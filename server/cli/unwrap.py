"""The servers a client config's commitgate entry serves, read back from its policy; and
`commitgate policy unwrap`, which puts them back into the config as they were.

A wrapped server lives on in its policy's `[upstreams.NAME]` (command, args, env, cwd, url, headers), every
value from the config there as written or as a `${NAME}` reference whose value the commitgate entry's
`env` holds. Reading both gives the server's original entry back (docs/wrapping.md).
"""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from commitgate.server.cli.client_configs import (
    ClientConfig,
    ClientConfigError,
    Secret,
    ServerEntry,
    read_client_config,
    shown,
    unwrapped,
    write_config,
)
from commitgate.server.cli.safe_files import FileRefused, read_regular

_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")
_VSCODE_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
_STDIO_KEYS = ("command", "args", "env", "cwd")
_HTTP_KEYS = ("url", "headers")


def add_arguments(unwrap: argparse.ArgumentParser) -> None:
    unwrap.description = (
        "Put the servers that a client config's commitgate entry serves back into the config as they"
        " were (secrets included, from the entry's env) and remove that entry; the config before is kept"
        " as FILE.bak (or FILE.bak.N), the policy and its ledger stay."
    )
    unwrap.add_argument("--from-config", required=True, metavar="FILE", help="the client's config")
    unwrap.add_argument(
        "--policy",
        metavar="P",
        help="the policy whose entry to unwrap (default: the one a commitgate entry of FILE serves)",
    )
    unwrap.set_defaults(func=cmd_unwrap)


def serving_entry(config: ClientConfig, policy: Path | None) -> ServerEntry | None:
    """The config's commitgate entry that serves `policy` (None: the only one that serves a policy)."""
    serving = [entry for entry in config.servers.values() if entry.served_policy is not None]
    if policy is not None:
        wanted = policy.expanduser().resolve()
        return next((e for e in serving if e.served_policy and e.served_policy.resolve() == wanted), None)
    return serving[0] if len(serving) == 1 else None


def read_policy_document(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        text = read_regular(path).decode("utf-8")
        return text, tomllib.loads(text)
    except FileNotFoundError:
        raise ClientConfigError(f"cannot read {path}: no such file") from None
    except FileRefused:
        raise
    except OSError as exc:
        raise ClientConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ClientConfigError(
            f"{path}: not a valid policy ({one_line_error(exc)}); fix it (`commitgate policy check`"
            " says where), or give --force to write it anew"
        ) from None


def one_line_error(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]


def served_entries(document: dict[str, Any], env: dict[str, str]) -> dict[str, ServerEntry]:
    """Each upstream of a policy as a server entry, values as the policy writes them and the secrets
    they refer to from `env` (the commitgate entry's), so that it can be started, or written again."""
    upstreams = document.get("upstreams")
    entries: dict[str, ServerEntry] = {}
    for name, block in (upstreams if isinstance(upstreams, dict) else {}).items():
        if not isinstance(block, dict) or not (_text(block.get("command")) or _text(block.get("url"))):
            continue
        entry = ServerEntry(name)
        if _text(block.get("command")):
            entry.command = block["command"]
            entry.args = [a for a in block.get("args", []) if isinstance(a, str)]
            entry.env = _strings(block.get("env"))
            entry.cwd = block["cwd"] if _text(block.get("cwd")) else None
        else:
            entry.url = block["url"]
            entry.transport = "sse" if block.get("transport") == "sse" else "streamable-http"
            entry.headers = _strings(block.get("headers"))
        for variable in sorted(set(_references(block))):
            if variable not in env:
                continue
            if _VSCODE_ENV.fullmatch(env[variable]):
                entry.environment.add(variable)  # the client passes its own variable on
            else:
                entry.secrets[f"variable {variable}"] = Secret(
                    variable, env[variable], f"variable {variable}"
                )
        entries[name] = entry
    return entries


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _strings(value: Any) -> dict[str, str]:
    return {str(k): v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}


def _references(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield from (m[1] for m in _REFERENCE.finditer(value))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _references(item)
    elif isinstance(value, list):
        for item in value:
            yield from _references(item)


def original_entry(entry: ServerEntry, env: dict[str, str], vscode: bool) -> tuple[dict[str, Any], set[str]]:
    """The client config entry `entry` came from: its references back to the values `env` holds; and
    the variables it refers to that `env` does not hold (left as references)."""
    missing: set[str] = set()

    def back(value: str) -> str:
        def value_of(match: re.Match[str]) -> str:
            if match[1] in env:
                return env[match[1]]
            missing.add(match[1])
            return "${env:" + match[1] + "}" if vscode else match[0]

        return _REFERENCE.sub(value_of, value)

    raw: dict[str, Any] = {}
    if entry.command is not None:
        if vscode:
            raw["type"] = "stdio"
        raw["command"] = back(entry.command)
        if entry.args:
            raw["args"] = [back(a) for a in entry.args]
        if entry.env:
            raw["env"] = {k: back(v) for k, v in entry.env.items()}
        if entry.cwd is not None:
            raw["cwd"] = back(entry.cwd)
    else:
        assert entry.url is not None
        raw["type"] = "sse" if entry.transport == "sse" else "http"
        raw["url"] = back(entry.url)
        if entry.headers:
            raw["headers"] = {k: back(v) for k, v in entry.headers.items()}
    return raw, missing


def cmd_unwrap(args: argparse.Namespace) -> int:
    config = read_client_config(Path(args.from_config).expanduser())
    policy = Path(args.policy) if args.policy else None
    entry = serving_entry(config, policy)
    if entry is None:
        serving = [f"{name} ({e.served_policy})" for name, e in config.servers.items() if e.served_policy]
        raise ClientConfigError(
            f"{config.path}: no commitgate entry serves {policy or 'a policy'}"
            + (f"; give --policy: {', '.join(serving)}" if serving else "; there is nothing to unwrap")
        )
    assert entry.served_policy is not None
    _, document = read_policy_document(entry.served_policy)
    env = entry.raw_env
    restored: dict[str, dict[str, Any]] = {}
    missing: set[str] = set()
    for name, served in served_entries(document, env).items():
        restored[name], unset = original_entry(served, env, config.vscode)
        missing |= unset
    clash = [name for name in restored if name in config.servers and name != entry.name]
    if clash:
        raise ClientConfigError(
            f"{config.path} has entries named {', '.join(map(shown, clash))} already; rename them, then unwrap"
        )
    rewrite = write_config(config, unwrapped(config, entry.name, restored))
    names = ", ".join(map(shown, restored)) or "no server"
    print(
        f"rewrote {config.path}: {shown(entry.name)} replaced by {names}, as {entry.served_policy} had them"
    )
    kept = "kept" if rewrite.backed_up_now else "already kept"
    print(f"The config before is {kept} as {rewrite.backup}; the policy and its ledger stay where they are.")
    if missing:
        print(
            f"Not in the entry's env, so written as references: {', '.join(sorted(missing))};"
            " set them where the client starts its servers."
        )
    print("Restart the client to use it.")
    return 0
