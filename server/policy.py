"""The policy file: pydantic models of DESIGN 1.8, loading, and every problem with its location.

Loading never stops at the first problem: TOML syntax, unknown keys, bad
values, unset `${ENV}` references and cross-field rules are all collected as
`Problem(location, message)` so `commitgate policy check` can print them at once.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from .durations import parse_duration
from .model import IdempotencyClass

Duration = Annotated[float, BeforeValidator(parse_duration)]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_PLACEHOLDER = re.compile(r"\{(arguments|result)((?:\.[A-Za-z0-9_\-]+)+)\}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class RetryPolicy(_Strict):
    attempts: int = Field(3, ge=1, le=100, description="All attempts, the first included.")
    initial: Duration = Field(0.1, description="First backoff delay.")
    max: Duration = Field(5.0, description="Largest backoff delay.")
    multiplier: float = Field(2.0, ge=1.0)
    jitter: Literal["full", "none"] = Field("full", description="Full jitter spreads retriers out.")
    deadline: Duration = Field(60.0, description="Overall time budget for one call, retries included.")


class HttpRequestSpec(_Strict):
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    url: str
    key_header: str = "Idempotency-Key"
    headers: dict[str, str] = Field(default_factory=dict)
    timeout: Duration | None = None
    body: Literal["json", "query", "none"] | None = None


class StatusCheckSpec(_Strict):
    python: str | None = None
    http: HttpRequestSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> StatusCheckSpec:
        if (self.python is None) == (self.http is None):
            raise ValueError("a status check has exactly one of `python` or `http`")
        return self


def _status_check_shorthand(value: Any) -> Any:
    return {"python": value} if isinstance(value, str) else value


class CompensateSpec(_Strict):
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolPolicy(_Strict):
    idempotency_class: IdempotencyClass = Field(alias="class")
    python: str | None = None
    http: HttpRequestSpec | None = None
    upstream: str | None = None
    upstream_tool: str | None = None
    input_schema: dict[str, Any] | None = None
    timeout: Duration = 30.0
    retry: RetryPolicy = Field(default_factory=lambda: RetryPolicy())
    forwards_key: bool = False
    status_check: Annotated[StatusCheckSpec | None, BeforeValidator(_status_check_shorthand)] = None
    compensate: CompensateSpec | None = None
    retention: Duration | None = None
    expose: bool = True
    destructive: bool = False
    title: str | None = None
    description: str | None = None

    @property
    def source_kind(self) -> str:
        return "python" if self.python else "http" if self.http else "upstream"


class LimitsPolicy(_Strict):
    max_argument_bytes: int = Field(1 << 20, ge=1)
    max_result_bytes: int = Field(4 << 20, ge=1)
    list_limit: int = Field(200, ge=1)
    max_concurrent_per_principal: int = Field(64, ge=1)


class ServerPolicy(_Strict):
    name: str = "commitgate"
    principal: str | None = None
    session: str = "default"
    retention: Duration = 86400.0
    respond_within: Duration = 25.0
    in_progress_wait: Duration = 10.0
    lease: Duration = 10.0
    limits: LimitsPolicy = Field(default_factory=lambda: LimitsPolicy())

    @property
    def max_argument_bytes(self) -> int:
        return self.limits.max_argument_bytes


class LedgerPolicy(_Strict):
    url: str | None = None
    synchronous: Literal["FULL", "NORMAL", "EXTRA"] = "FULL"


class AuthToken(_Strict):
    principal: str
    token_env: str | None = None
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")

    @model_validator(mode="after")
    def _one_secret(self) -> AuthToken:
        if (self.token_env is None) == (self.token_sha256 is None):
            raise ValueError("each token has exactly one of `token_env` or `token_sha256`")
        return self


class AuthPolicy(_Strict):
    tokens: list[AuthToken] = Field(default_factory=list)


class UpstreamPolicy(_Strict):
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    transport: Literal["streamable-http", "sse"] = "streamable-http"
    headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_target(self) -> UpstreamPolicy:
        if (self.command is None) == (self.url is None):
            raise ValueError("an upstream has exactly one of `command` or `url`")
        return self


class Policy(_Strict):
    server: ServerPolicy = Field(default_factory=lambda: ServerPolicy())
    ledger: LedgerPolicy = Field(default_factory=lambda: LedgerPolicy())
    auth: AuthPolicy | None = None
    upstreams: dict[str, UpstreamPolicy] = Field(default_factory=dict)
    tools: dict[str, ToolPolicy] = Field(default_factory=dict)

    def retention_for(self, tool: str) -> float:
        policy = self.tools.get(tool)
        return policy.retention if policy and policy.retention is not None else self.server.retention


# --- problems --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Problem:
    location: str
    message: str

    def __str__(self) -> str:
        return f"{self.location}: {self.message}" if self.location else self.message


class PolicyError(Exception):
    """Every problem found in a policy; `str()` lists them one per line."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems))


def _location(loc: tuple[Any, ...]) -> str:
    # pydantic reports union members and validator names in loc; keep only the path in the file.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
    return ".".join(parts)


def _pydantic_problems(error: ValidationError) -> list[Problem]:
    problems = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key (check its spelling; see `commitgate policy schema`)"
        elif item["type"] == "missing":
            message = "required key is missing"
        problems.append(Problem(_location(item["loc"]), message))
    return problems


def _substitute_env(value: Any, location: str, problems: list[Problem]) -> Any:
    """Resolve `${NAME}` references in every string at load time."""
    if isinstance(value, dict):
        return {
            k: _substitute_env(v, f"{location}.{k}" if location else k, problems) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_substitute_env(v, f"{location}[{i}]", problems) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:

        def resolve(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in os.environ:
                problems.append(Problem(location, f"environment variable {name} is not set"))
                return ""
            return os.environ[name]

        return _ENV_REF.sub(resolve, value)
    return value


def _cross_field_problems(policy: Policy) -> list[Problem]:
    problems: list[Problem] = []
    for name, tool in policy.tools.items():
        where = f"tools.{name}"
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", name):
            problems.append(
                Problem(where, "tool names are 1-128 characters of letters, digits, '_', '-', '.'")
            )
        sources = [s for s in ("python", "http", "upstream") if getattr(tool, s) is not None]
        if len(sources) != 1:
            found = ", ".join(sources) or "none"
            problems.append(
                Problem(where, f"exactly one source of python, http, upstream is needed (found: {found})")
            )
        if tool.upstream is not None and tool.upstream not in policy.upstreams:
            problems.append(Problem(f"{where}.upstream", f"no [upstreams.{tool.upstream}] is declared"))
        if tool.upstream_tool is not None and tool.upstream is None:
            problems.append(Problem(f"{where}.upstream_tool", "only meaningful with `upstream`"))
        if tool.http is not None and tool.input_schema is None:
            problems.append(
                Problem(f"{where}.input_schema", "an http tool needs an input_schema (JSON Schema)")
            )
        cls = tool.idempotency_class
        if cls is IdempotencyClass.KEY_AND_STATUS_CHECK and tool.status_check is None:
            problems.append(
                Problem(f"{where}.status_check", "class key-and-status-check needs a status_check")
            )
        if cls is IdempotencyClass.COMPENSABLE:
            problems.extend(_compensation_problems(policy, name, tool))
        elif tool.compensate is not None:
            problems.append(
                Problem(f"{where}.compensate", "only tools of class compensable declare compensate")
            )
        if cls is IdempotencyClass.SAFE_RETRY and tool.forwards_key:
            problems.append(Problem(f"{where}.forwards_key", "safe-retry tools take no key to forward"))
    return problems


def _compensation_problems(policy: Policy, name: str, tool: ToolPolicy) -> list[Problem]:
    where = f"tools.{name}.compensate"
    if tool.compensate is None:
        return [Problem(where, "class compensable needs compensate = {tool = ..., arguments = {...}}")]
    problems = []
    target = policy.tools.get(tool.compensate.tool)
    if target is None:
        problems.append(Problem(f"{where}.tool", f"no tool named {tool.compensate.tool!r} in [tools]"))
    elif not target.idempotency_class.keyed:
        problems.append(Problem(f"{where}.tool", "a compensating tool must be keyed (not safe-retry)"))
    for key, value in tool.compensate.arguments.items():
        for match in _PLACEHOLDER.finditer(str(value)):
            first = match.group(2).split(".")[1]
            if match.group(1) == "arguments" and not _argument_may_exist(tool, first):
                problems.append(
                    Problem(f"{where}.arguments.{key}", f"the forward call has no argument {first!r}")
                )
    return problems


def _argument_may_exist(tool: ToolPolicy, name: str) -> bool:
    if tool.input_schema is None:
        return True  # python and upstream schemas are only known once loaded
    return name in tool.input_schema.get("properties", {})


# --- loading -----------------------------------------------------------------------


def parse_policy(data: dict[str, Any], source: str = "<policy>") -> Policy:
    problems: list[Problem] = []
    data = _substitute_env(data, "", problems)
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, problems + _pydantic_problems(exc)) from None
    problems += _cross_field_problems(policy)
    if problems:
        raise PolicyError(source, problems)
    return policy


def load_policy(path: Path | str) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(
            str(path), [Problem("", f"cannot read the policy file: {exc.strerror or exc}")]
        ) from None
    return loads_policy(text, str(path))


def loads_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(source, [Problem("", f"TOML syntax error: {exc}")]) from None
    return parse_policy(data, source)


def default_policy_text() -> str:
    return resources.files("commitgate.policies").joinpath("default.toml").read_text(encoding="utf-8")


def default_policy() -> Policy:
    return loads_policy(default_policy_text(), "default.toml (bundled)")
