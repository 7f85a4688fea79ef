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
import unicodedata
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from commitgate.server.cli import jsonc
from commitgate.server.cli.policy_writing import one_line
from commitgate.server.cli.safe_files import (
    FileRefused,
    backup,
    permissions,
    read_regular,
    refuse_link,
    replace_file,
)
from commitgate.server.model.errors import UserFacingError
from commitgate.server.policy.masking import secret_name

# VS Code's `${env:NAME}` is the policy's `${NAME}`.
_VSCODE_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")
# An HTTP header name (RFC 9110 token): anything else could split a header or a line.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
MAX_NAME = 128
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]+")


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
        return "${input:" not in self.value


@dataclass(slots=True)
class ServerEntry:
    """One server of a client config, as an upstream of commitgate: every value as the policy
    writes it (`${NAME}` references in place of secrets and of anything a policy would read as one)."""

    name: str
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    transport: Literal["streamable-http", "sse"] = "streamable-http"
    headers: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, Secret] = field(default_factory=dict)  # by where they were: "env NAME", ...
    environment: set[str] = field(default_factory=set)  # what the client reads from its own (`${env:NAME}`)
    raw: dict[str, Any] = field(default_factory=dict)  # the config's own entry

    @property
    def runs_commitgate(self) -> bool:
        """The entry already starts commitgate (init would wrap commitgate in itself)."""
        if self.command is None:
            return False
        words = [Path(self.command).name, *self.args]
        return Path(self.command).name.startswith("commitgate") or any(
            w == "commitgate" or w.startswith("commitgate.server") for w in words
        )

    @property
    def served_policy(self) -> Path | None:
        """The policy a commitgate entry serves: `--policy P`, `--policy=P` or `COMMITGATE_POLICY`."""
        if not self.runs_commitgate:
            return None
        for i, arg in enumerate(self.args):
            if arg == "--policy" and i + 1 < len(self.args):
                return Path(self.args[i + 1]).expanduser().absolute()
            if arg.startswith("--policy="):
                return Path(arg.partition("=")[2]).expanduser().absolute()
        env = self.raw.get("env")
        policy = env.get("COMMITGATE_POLICY") if isinstance(env, dict) else None
        return Path(policy).expanduser().absolute() if isinstance(policy, str) and policy else None

    @property
    def raw_env(self) -> dict[str, str]:
        env = self.raw.get("env")
        return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}

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
    data: bytes = b""  # the file's bytes as read: a rewrite refuses if they changed meanwhile

    @property
    def table(self) -> dict[str, Any]:
        node: Any = self.document
        for key in self.where:
            node = node[key]
        return dict(node)

    @property
    def vscode(self) -> bool:
        return self.where[-1] == "servers"


def read_client_config(path: Path) -> ClientConfig:
    """Read and check a client config; every way it can be wrong is one line saying what and where."""
    try:
        data = read_regular(path)
    except FileNotFoundError as exc:
        raise ClientConfigError(
            f"cannot read {path}: no such file (`commitgate claude-config` says where Claude Desktop's"
            " config is on this machine)"
        ) from exc
    except FileRefused as exc:
        raise ClientConfigError(str(exc)) from exc
    except OSError as exc:
        raise ClientConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return parse_client_config(path, data)


def parse_client_config(path: Path, data: bytes) -> ClientConfig:
    try:
        # Windows editors may start the file with a BOM; its line ends are kept for a rewrite.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ClientConfigError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None
    try:
        parsed = jsonc.loads(text)
    except json.JSONDecodeError as exc:
        raise ClientConfigError(
            f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); an MCP client config is a JSON"
            " object (comments and trailing commas allowed) with `mcpServers` (Claude Desktop, Cursor)"
            " or `servers` (VS Code)"
        ) from None
    except RecursionError:
        raise ClientConfigError(f"{path}: nested too deeply to be an MCP client config") from None
    except ValueError as exc:  # e.g. a number of thousands of digits
        raise ClientConfigError(f"{path}: not a client config: {str(exc)[:200]}") from None
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
    for raw in table.values():  # variables that a commitgate entry passes on keep their names
        if isinstance(raw, dict) and isinstance(raw.get("env"), dict) and _entry_runs_commitgate(raw):
            used.update({str(k): str(v) for k, v in raw["env"].items()})
    servers = {name: _entry(path, name, raw, used) for name, raw in table.items()}
    return ClientConfig(path, document, where, servers, text, parsed.had_comments, data)


def _entry_runs_commitgate(raw: dict[str, Any]) -> bool:
    command, args = raw.get("command"), raw.get("args")
    if not isinstance(command, str) or not command:
        return False
    return ServerEntry("", command, [str(a) for a in args] if isinstance(args, list) else []).runs_commitgate


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


def unusable(name: str) -> str | None:
    """Why `name` cannot name an upstream, an env variable or a header, or None: empty, too long, or a
    line break, control or format character (which would start a new line in files and logs)."""
    if not name:
        return "it is empty"
    bad = next((c for c in name if unicodedata.category(c).startswith("C")), None)
    if bad is not None:
        kind = "a line break" if bad in "\r\n\x0b\x0c\x85\u2028\u2029" else "a control or format character"
        return f"it has {kind} ({bad!r})"
    if len(name) > MAX_NAME:
        return f"it is longer than {MAX_NAME} characters"
    return None


def plain_name(name: str) -> str:
    """A name of letters, digits and `_ - .` close to `name` (what to rename it to)."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", name).strip("_")[:MAX_NAME] or "server"


def _entry(path: Path, name: str, raw: Any, used: dict[str, str]) -> ServerEntry:
    why = unusable(name)
    if why is not None:
        raise ClientConfigError(
            f"{path}: server name {shown(name)} cannot name an upstream: {why}; rename it in the config"
            f" (e.g. to {plain_name(name)!r}) and run again"
        )
    where = f"{path}: server {shown(name)}"
    if not isinstance(raw, dict):
        raise ClientConfigError(f"{where}: expected an object with `command` or `url`")
    entry = ServerEntry(name, raw=raw)
    if isinstance(raw.get("command"), str) and raw["command"]:
        entry.command = raw["command"]
        entry.args = [str(a) for a in _typed(where, raw, "args", list)]
        entry.cwd = raw.get("cwd") if isinstance(raw.get("cwd"), str) else None
        if entry.runs_commitgate:
            return entry  # not wrapped: nothing of it goes into a policy
        entry.command = _literal(entry, "command", entry.command, used)
        entry.args = _arguments(entry, entry.args, used)
        entry.cwd = _literal(entry, "cwd", entry.cwd, used) if entry.cwd is not None else None
        for key, value in _typed(where, raw, "env", dict).items():
            _usable(where, "env variable", key)
            if "=" in key:
                raise ClientConfigError(f"{where}: env variable {shown(key)} has a '='; rename it")
            entry.env[key] = _secret(entry, f"env {key}", key, _text(value), used)
    elif isinstance(raw.get("url"), str) and raw["url"]:
        entry.url = _url(entry, raw["url"], used)
        kind = str(raw.get("type") or raw.get("transport") or "streamable-http").lower()
        entry.transport = "sse" if kind == "sse" else "streamable-http"
        for key, value in _typed(where, raw, "headers", dict).items():
            if not _HEADER_NAME.fullmatch(key):
                raise ClientConfigError(
                    f"{where}: header name {shown(key)} is not a valid HTTP header name (letters, digits"
                    " and !#$%&'*+-.^_`|~ only); fix it in the config"
                )
            entry.headers[key] = _secret(entry, f"header {key}", key, _text(value), used)
    else:
        raise ClientConfigError(f"{where}: has neither `command` (stdio) nor `url` (HTTP)")
    return entry


def shown(text: str) -> str:
    """A name quoted for one line of output: `'name'`, or as JSON with every line break and control
    character escaped when it has more than letters, digits and `_ - .`."""
    return f"'{text}'" if _PLAIN.fullmatch(text) else one_line(json.dumps(text, ensure_ascii=False))


def bare(text: str) -> str:
    """A name for one line of output: as it is when plain, else as `shown` quotes it."""
    return text if _PLAIN.fullmatch(text) else shown(text)


def _usable(where: str, kind: str, name: str) -> None:
    why = unusable(name)
    if why is not None:
        raise ClientConfigError(
            f"{where}: {kind} {shown(name)} cannot be used: {why}; rename it in the config"
        )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _typed(where: str, raw: dict[str, Any], key: str, kind: type) -> Any:
    value = raw.get(key)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise ClientConfigError(f"{where}: `{key}` must be {'a list' if kind is list else 'an object'}")
    return value


# --- values as the policy writes them ------------------------------------------------------------------


def _secret(entry: ServerEntry, where: str, key: str, value: str, used: dict[str, str]) -> str:
    """A value of `env` or `headers`, as the policy writes it: a `${NAME}` reference, never the value
    (VS Code's `${env:NAME}` is the policy's `${NAME}`: the client reads its environment, so does serve)."""
    if _VSCODE_ENV.search(value) and "${" not in _VSCODE_ENV.sub("", value):
        entry.environment.update(m[1] for m in _VSCODE_ENV.finditer(value))
        return _VSCODE_ENV.sub(r"${\1}", value)
    return _reference(entry, where, key, value, used)


def _reference(entry: ServerEntry, where: str, key: str, value: str, used: dict[str, str]) -> str:
    variable = _variable_name(entry.name, key, value, where.startswith("env "), used)
    entry.secrets[where] = Secret(variable, value, where)
    return "${" + variable + "}"


def _literal(entry: ServerEntry, where: str, value: str, used: dict[str, str]) -> str:
    """A value kept as it is, unless the policy would read part of it as a `${NAME}` reference: then it
    is carried, as data, in a variable of its own."""
    if "${" not in value:
        return value
    return _reference(entry, where, where.replace(" ", "_"), value, used)


def _arguments(entry: ServerEntry, args: list[str], used: dict[str, str]) -> list[str]:
    """Arguments with credentials as references: `--token=V`, `--token V`, `TOKEN=V`,
    `Authorization: V`, a URL's password or key-like query values."""
    written: list[str] = []
    after_flag: str | None = None
    for i, arg in enumerate(args):
        where = f"argument {i + 1}"
        flag, equals, value = arg.partition("=")
        header, colon, header_value = arg.partition(":")
        if "${" in arg:
            written.append(_literal(entry, where, arg, used))
        elif after_flag is not None and not arg.startswith("-"):
            written.append(_reference(entry, where, after_flag.lstrip("-"), arg, used))
        elif equals and value and secret_name(flag) and " " not in flag:
            written.append(f"{flag}={_reference(entry, where, flag.lstrip('-'), value, used)}")
        elif colon and header_value.strip() and _HEADER_NAME.fullmatch(header) and secret_name(header):
            written.append(f"{header}: {_reference(entry, where, header, header_value.strip(), used)}")
        elif "://" in arg:
            written.append(_url(entry, arg, used, where=where, every_query_value=False))
        else:
            written.append(arg)
        after_flag = arg if arg.startswith("-") and not equals and secret_name(arg) else None
    return written


def _url(
    entry: ServerEntry, url: str, used: dict[str, str], *, where: str = "url", every_query_value: bool = True
) -> str:
    """A URL with its user, password and query values as references (only key-like query values and
    the password for a URL in an argument, such as a database DSN)."""
    if "${" in url:
        return _literal(entry, where, url, used)
    try:
        parts = urllib.parse.urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:
        return _literal(entry, where, url, used) if "@" in url or "?" in url else url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        name, colon, secret = userinfo.partition(":")
        if every_query_value and user:
            name = _reference(entry, f"{where} user", f"{where}_user", name, used)
        if colon and password is not None:
            secret = _reference(entry, f"{where} password", f"{where}_password", secret, used)
        netloc = f"{name}{colon}{secret}@{host}"
    query = []
    for pair in parts.query.split("&") if parts.query else []:
        key, equals, value = pair.partition("=")
        if equals and value and (every_query_value or secret_name(urllib.parse.unquote(key))):
            value = _reference(entry, f"{where} query {key}", f"{where}_{key}", value, used)
        query.append(f"{key}{equals}{value}")
    rebuilt = url.split("://", 1)[0] + "://" + netloc + url.split("://", 1)[1][len(parts.netloc) :]
    if parts.query:
        rebuilt = rebuilt.replace("?" + parts.query, "?" + "&".join(query), 1)
    return rebuilt


def _variable_name(server: str, key: str, value: str, plain_first: bool, used: dict[str, str]) -> str:
    """The env name itself when no other server uses it for another value; else prefixed with the server."""
    plain = re.sub(r"[^A-Za-z0-9_]", "_", key).upper()
    if plain_first and used.get(plain, value) == value and re.match(r"[A-Za-z_]", plain):
        used[plain] = value
        return plain
    prefixed = re.sub(r"[^A-Za-z0-9_]+", "_", f"{server}_{key}").upper().strip("_")
    name = prefixed if re.match(r"[A-Za-z_]", prefixed) else f"MCP_{prefixed}"
    while used.get(name, value) != value:
        name += "_"
    used[name] = value
    return name


# --- rewriting ----------------------------------------------------------------------------------------


def rewritten(config: ClientConfig, wrapped: list[str], name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The servers table with the wrapped servers replaced by one entry `name` (where the first of them,
    or an entry `name` already there, was); the others stay in place."""
    servers: dict[str, Any] = {}
    for key, value in config.table.items():
        if key in wrapped or key == name:
            servers.setdefault(name, entry)
        else:
            servers[key] = value
    servers.setdefault(name, entry)
    return servers


def unwrapped(config: ClientConfig, name: str, restored: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The servers table with the entry `name` replaced, in its place, by the `restored` entries."""
    servers: dict[str, Any] = {}
    for key, value in config.table.items():
        if key == name:
            servers.update(restored)
        else:
            servers[key] = value
    return servers


@dataclass(frozen=True, slots=True)
class Rewrite:
    backup: Path  # the config as it was before
    backed_up_now: bool  # False: an identical backup was there already
    dropped_comments: bool  # comments inside the servers table are not kept


def write_config(config: ClientConfig, servers: dict[str, Any]) -> Rewrite:
    """Write the config with `servers` as its servers table, the rest of the file as it was (comments
    included), after a backup; refused if the file changed since it was read, or is a link."""
    text, dropped = jsonc.replace_value(config.text, config.where, servers)
    refuse_link(config.path)
    if read_regular(config.path) != config.data:
        raise ClientConfigError(
            f"{config.path} changed while commitgate was reading its servers; nothing was written to it:"
            " run the command again"
        )
    mode = permissions(config.path)
    saved, now = backup(config.path, config.data, mode)
    bom = "\ufeff" if config.data.startswith(b"\xef\xbb\xbf") else ""
    replace_file(config.path, (bom + text).encode("utf-8"), mode)
    return Rewrite(saved, now, dropped)
