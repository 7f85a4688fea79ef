"""MCP client config files: the servers Claude Desktop, Cursor or VS Code start, read and rewritten.

Claude Desktop and Cursor list servers under `mcpServers`, VS Code under `servers` (in `.vscode/mcp.json`)
or `mcp.servers` (in its settings). An entry is either stdio (`command`, `args`, `env`, `cwd`) or HTTP
(`url`, `headers`, `type` or `transport`). VS Code's files are JSONC (comments, trailing commas), so
every config is read as such, and a rewrite replaces the servers table alone. See docs/wrapping.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from commitgate.server.cli import jsonc
from commitgate.server.model.errors import UserFacingError

# Environment variables whose values are credentials: written to a policy as `${NAME}`, never in clear.
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|PWD|AUTH|CREDENTIAL|PRIVATE|COOKIE|SESSION", re.IGNORECASE)
# VS Code's `${env:NAME}` is the policy's `${NAME}`.
_VSCODE_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ClientConfigError(UserFacingError):
    """The client config cannot be read as one: what is wrong and where."""


@dataclass(frozen=True, slots=True)
class Secret:
    """A value the policy refers to as `${variable}`; `value` is what the client config holds."""

    variable: str
    value: str  # as the client config has it
    where: str  # e.g. "env GITHUB_TOKEN" or "header Authorization"

    @property
    def known(self) -> bool:
        """False for a value the client asks the user for (VS Code's `${input:...}`)."""
        return "${" not in self.value


@dataclass(slots=True)
class ServerEntry:
    """One server of a client config, as an upstream of commitgate."""

    name: str
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    transport: Literal["streamable-http", "sse"] = "streamable-http"
    headers: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, Secret] = field(default_factory=dict)  # by env name or header name
    environment: set[str] = field(default_factory=set)  # what the client reads from its own (`${env:NAME}`)

    @property
    def runs_commitgate(self) -> bool:
        """The entry already starts commitgate (init would wrap commitgate in itself)."""
        if self.command is None:
            return False
        words = [Path(self.command).name, *self.args]
        return Path(self.command).name.startswith("commitgate") or any(
            w == "commitgate" or w.startswith("commitgate.server") for w in words
        )

    def resolved(self, written: str) -> str:
        """A written value with its `${NAME}` references replaced, to start the server now."""
        values = {s.variable: s.value for s in self.secrets.values() if s.known}
        return _REFERENCE.sub(lambda m: values.get(m[1], os.environ.get(m[1], "")), written)


@dataclass(slots=True)
class ClientConfig:
    """A parsed client config: the whole document, where its servers sit, and each entry."""

    path: Path
    document: dict[str, Any]
    where: tuple[str, ...]  # keys from the document to the servers table
    servers: dict[str, ServerEntry]
    text: str  # as read: a rewrite changes the servers table and keeps the rest
    had_comments: bool = False

    @property
    def table(self) -> dict[str, Any]:
        node: Any = self.document
        for key in self.where:
            node = node[key]
        return dict(node)


def read_client_config(path: Path) -> ClientConfig:
    try:
        # Windows editors may start the file with a BOM; its line ends are kept for a rewrite.
        with path.open(encoding="utf-8-sig", newline="") as file:
            text = file.read()
    except FileNotFoundError as exc:
        raise ClientConfigError(
            f"cannot read {path}: no such file (`commitgate claude-config` says where Claude Desktop's"
            " config is on this machine)"
        ) from exc
    except OSError as exc:
        raise ClientConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        parsed = jsonc.loads(text)
    except json.JSONDecodeError as exc:
        raise ClientConfigError(
            f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); an MCP client config is a JSON"
            " object (comments and trailing commas allowed) with `mcpServers` (Claude Desktop, Cursor)"
            " or `servers` (VS Code)"
        ) from exc
    document = parsed.value
    where = _servers_key(document)
    if where is None:
        raise ClientConfigError(
            f"{path}: no `mcpServers` (Claude Desktop, Cursor) or `servers` (VS Code) object in it"
        )
    table: Any = document
    for key in where:
        table = table[key]
    used: dict[str, str] = {}
    servers = {name: _entry(path, name, raw, used) for name, raw in table.items()}
    return ClientConfig(path, document, where, servers, text, parsed.had_comments)


def _servers_key(document: Any) -> tuple[str, ...] | None:
    if not isinstance(document, dict):
        return None
    for where in (("mcpServers",), ("servers",), ("mcp", "servers")):
        node: Any = document
        for key in where:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            return where
    return None


def _entry(path: Path, name: str, raw: Any, used: dict[str, str]) -> ServerEntry:
    where = f"{path}: server {name!r}"
    if not isinstance(raw, dict):
        raise ClientConfigError(f"{where}: expected an object with `command` or `url`")
    entry = ServerEntry(name)
    if isinstance(raw.get("command"), str) and raw["command"]:
        entry.command = raw["command"]
        entry.args = [str(a) for a in _typed(where, raw, "args", list)]
        entry.cwd = raw.get("cwd") if isinstance(raw.get("cwd"), str) else None
        for key, value in _typed(where, raw, "env", dict).items():
            entry.env[key] = _secret_or_value(entry, "env", key, str(value), used)
    elif isinstance(raw.get("url"), str) and raw["url"]:
        entry.url = raw["url"]
        kind = str(raw.get("type") or raw.get("transport") or "streamable-http").lower()
        entry.transport = "sse" if kind == "sse" else "streamable-http"
        for key, value in _typed(where, raw, "headers", dict).items():
            entry.headers[key] = _secret_or_value(entry, "header", key, str(value), used, always=True)
    else:
        raise ClientConfigError(f"{where}: has neither `command` (stdio) nor `url` (HTTP)")
    return entry


def _typed(where: str, raw: dict[str, Any], key: str, kind: type) -> Any:
    value = raw.get(key)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise ClientConfigError(f"{where}: `{key}` must be {'a list' if kind is list else 'an object'}")
    return value


def _secret_or_value(
    entry: ServerEntry, kind: str, key: str, value: str, used: dict[str, str], *, always: bool = False
) -> str:
    """The value as the policy writes it: a credential (every header, an env name that says so, or a
    value the client asks the user for) becomes a `${NAME}` reference; the rest stays as it is."""
    if _VSCODE_ENV.search(value):
        entry.environment.update(m[1] for m in _VSCODE_ENV.finditer(value))
        return _VSCODE_ENV.sub(r"${\1}", value)  # the client reads the environment: so does the policy
    if not (always or _SECRET_NAME.search(key) or "${" in value):
        return value
    variable = _variable_name(entry.name, key, value, kind, used)
    entry.secrets[key] = Secret(variable, value, f"{kind} {key}")
    return "${" + variable + "}"


def _variable_name(server: str, key: str, value: str, kind: str, used: dict[str, str]) -> str:
    """The env name itself when no other server uses it for another value; else prefixed with the server."""
    plain = re.sub(r"[^A-Za-z0-9_]", "_", key).upper()
    if kind == "env" and used.get(plain, value) == value and re.match(r"[A-Za-z_]", plain):
        used[plain] = value
        return plain
    prefixed = re.sub(r"[^A-Za-z0-9_]", "_", f"{server}_{key}").upper().strip("_")
    name = prefixed if re.match(r"[A-Za-z_]", prefixed) else f"MCP_{prefixed}"
    while used.get(name, value) != value:
        name += "_"
    used[name] = value
    return name


# --- rewriting ----------------------------------------------------------------------------------------


def rewritten(config: ClientConfig, wrapped: list[str], name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The servers table with the wrapped servers replaced by one entry `name`; others stay in place."""
    servers: dict[str, Any] = {}
    for key, value in config.table.items():
        if key in wrapped:
            servers.setdefault(name, entry)  # where the first wrapped server was
        elif key != name:
            servers[key] = value
    servers.setdefault(name, entry)
    return servers


def write_with_backup(config: ClientConfig, servers: dict[str, Any]) -> tuple[Path, bool]:
    """Write the config with `servers` as its servers table, keeping the original as `FILE.bak`; the
    rest of the file stays as it was, comments included. True when comments inside the table went."""
    text, dropped = jsonc.replace_value(config.text, config.where, servers)
    backup = config.path.with_name(config.path.name + ".bak")
    shutil.copy2(config.path, backup)
    with config.path.open("w", encoding="utf-8", newline="") as file:
        file.write(text)
    return backup, dropped
