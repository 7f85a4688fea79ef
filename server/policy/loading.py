"""Loading a policy: reading the file, TOML, `${ENV}` references, validation and the rules.

Loading never stops at the first problem: TOML syntax, unknown keys, bad values, unset `${ENV}`
references and the rules between keys are all collected as `Problem(location, message, line)` so
`commitgate policy check` can print them at once.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.policy.evidence import literal_secrets
from commitgate.server.policy.models import FROM_FILE, Policy, ToolPolicy
from commitgate.server.policy.problems import PolicyError, Problem, pydantic_problems, toml_key, with_lines
from commitgate.server.policy.rules import cross_field_problems, raw_tables
from commitgate.server.policy.tokens import shared_token_problems

# `${NAME}` or `${NAME:-default}` in any string of the file, resolved at load time.
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _substitute_env(
    value: Any, location: str, problems: list[Problem], unset: list[str] | None = None
) -> Any:
    """Resolve `${NAME}` and `${NAME:-default}` in every string at load time. With `unset`, a
    variable that is not set is noted there rather than as a problem."""
    if isinstance(value, dict):
        return {
            k: _substitute_env(v, f"{location}.{toml_key(k)}" if location else toml_key(k), problems, unset)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_substitute_env(v, f"{location}[{i}]", problems, unset) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:

        def resolve(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            if unset is not None:
                unset.append(name)
                return ""
            problems.append(
                Problem(location, f"environment variable {name} is not set (or write ${{{name}:-default}})")
            )
            return ""

        return _ENV_REF.sub(resolve, value)
    return value


@dataclass(frozen=True, slots=True)
class PolicyReport:
    """The outcome of reading a policy: the policy when valid, every problem otherwise."""

    source: str
    policy: Policy | None
    problems: list[Problem]
    data: dict[str, Any] | None = None  # the document after `${ENV}` resolution
    text: str | None = None

    def valid_tools(self) -> dict[str, ToolPolicy]:
        """Tools that validate on their own, so their sources can be checked even in a broken file."""
        if self.policy is not None:
            return dict(self.policy.tools)
        valid: dict[str, ToolPolicy] = {}
        for name, raw in raw_tables((self.data or {}).get("tools")).items():
            tool = _buildable(raw)
            if tool is not None:
                valid[name] = tool
        return valid


def _buildable(raw: dict[str, Any]) -> ToolPolicy | None:
    """The tool with its invalid settings left at their defaults, so its source can still be checked.

    Its own problems are reported already; this only keeps them from hiding the source's (a module
    that does not import, a function that is missing) until they are fixed.
    """
    try:
        return ToolPolicy.model_validate(raw, context=FROM_FILE)
    except ValidationError as exc:
        broken = {str(item["loc"][0]) for item in exc.errors() if item["loc"]}
    if not broken or broken & {"python", "http", "upstream", "upstream_tool", "input_schema"}:
        return None
    repaired = {k: v for k, v in raw.items() if k not in broken}
    if "class" in broken:
        repaired["class"] = IdempotencyClass.KEY_REQUIRED.value  # any keyed class builds the same source
    try:
        return ToolPolicy.model_validate(repaired, context=FROM_FILE)
    except ValidationError:
        return None


# An upstream's own secrets: unset, they keep that upstream from starting, not the whole policy.
_UPSTREAM_SECRETS = ("env", "headers")


def _resolve_upstreams(upstreams: Any, problems: list[Problem]) -> tuple[Any, dict[str, list[str]]]:
    """`[upstreams]` resolved, and per upstream the variables its `env` and `headers` name that are
    not set: that upstream cannot start, and only it (`UpstreamPolicy.unset_env`)."""
    if not isinstance(upstreams, dict):
        return _substitute_env(upstreams, "upstreams", problems), {}
    resolved: dict[str, Any] = {}
    unset: dict[str, list[str]] = {}
    for name, table in upstreams.items():
        where = f"upstreams.{toml_key(name)}"
        if not isinstance(table, dict):
            resolved[name] = _substitute_env(table, where, problems)
            continue
        names: list[str] = []
        resolved[name] = {
            key: _substitute_env(
                value, f"{where}.{toml_key(key)}", problems, names if key in _UPSTREAM_SECRETS else None
            )
            for key, value in table.items()
        }
        if names:
            unset[name] = list(dict.fromkeys(names))
    return resolved, unset


def _dedupe(problems: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))


def analyse_data(data: dict[str, Any], source: str = "<policy>", text: str | None = None) -> PolicyReport:
    problems = [Problem(where, why) for where, why in literal_secrets(data)]
    others = _substitute_env({k: v for k, v in data.items() if k != "upstreams"}, "", problems)
    upstreams, unset = _resolve_upstreams(data.get("upstreams", {}), problems)
    data = {k: upstreams if k == "upstreams" else others[k] for k in data}
    policy: Policy | None = None
    try:
        policy = Policy.model_validate(data, context=FROM_FILE)
    except ValidationError as exc:
        problems += pydantic_problems(exc)
    else:
        problems += shared_token_problems(policy.auth)
    for name, names in unset.items():
        if policy is not None and name in policy.upstreams:
            policy.upstreams[name].mark_unset(names)
    problems = _dedupe(problems + cross_field_problems(data))
    if text is not None:
        problems = sorted(with_lines(problems, text), key=lambda p: (p.line is None, p.line or 0))
    return PolicyReport(source, policy if not problems else None, problems, data, text)


def _syntax_problem(exc: tomllib.TOMLDecodeError) -> Problem:
    message = str(exc)
    line = column = None
    match = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
    if match:
        line, column = int(match.group(1)), int(match.group(2))
        message = message[: match.start()]
    message = message.removesuffix(" (at end of document)")
    twice = re.match(r"Cannot declare \((.*)\) twice", message)
    if twice:
        name = ".".join(p.strip().strip("'\"") for p in twice.group(1).split(",") if p.strip())
        message = f"table [{name}] is declared twice"
    elif message == "Cannot overwrite a value":
        message = "this key is already set (each key may appear once per table)"
    return Problem("", f"TOML syntax error: {message}", line, column)


def analyse_text(text: str, source: str = "<policy>") -> PolicyReport:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return PolicyReport(source, None, [_syntax_problem(exc)], None, text)
    except RecursionError:
        problem = Problem("", "TOML nested too deeply to read (arrays or tables within each other)")
        return PolicyReport(source, None, [problem], None, None)
    return analyse_data(data, source, text)


class NotAPolicyFile(OSError):
    """The path names something other than a regular file (a directory, a FIFO, a device...)."""


def read_policy_file(path: Path | str) -> str:
    """The policy's text; a path that is not a regular file is refused before anything is read.

    Opened without blocking, so a FIFO put in the policy's place cannot hang the reader waiting
    for a writer; a device or a FIFO is never read at all.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise NotAPolicyFile("this is a directory, not a policy file")
        if not stat.S_ISREG(mode):
            raise NotAPolicyFile("not a regular file (a FIFO, socket or device?); refusing to read it")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read()
    finally:
        os.close(fd)
    return data.decode("utf-8")


def analyse_file(path: Path | str) -> PolicyReport:
    path = Path(path)
    try:
        text = read_policy_file(path)
    except NotAPolicyFile as exc:
        return PolicyReport(str(path), None, [Problem("", str(exc))])
    except IsADirectoryError:
        return PolicyReport(str(path), None, [Problem("", "this is a directory, not a policy file")])
    except FileNotFoundError:
        return PolicyReport(str(path), None, [Problem("", "no such file")])
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        return PolicyReport(str(path), None, [Problem("", f"cannot read the policy file: {reason}")])
    return analyse_text(text, str(path))


def _valid(report: PolicyReport) -> Policy:
    if report.policy is None:
        raise PolicyError(report.source, report.problems)
    return report.policy


def load_policy(path: Path | str) -> Policy:
    return _valid(analyse_file(path))


def loads_policy(text: str, source: str = "<policy>") -> Policy:
    return _valid(analyse_text(text, source))


def default_policy_text() -> str:
    return resources.files("commitgate.policies").joinpath("default.toml").read_text(encoding="utf-8")


def default_policy() -> Policy:
    return loads_policy(default_policy_text(), "default.toml (bundled)")
