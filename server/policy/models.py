"""The policy file (docs/policy.md): pydantic models, loading, and every problem with its location.

Loading never stops at the first problem: TOML syntax, unknown keys, bad
values, unset `${ENV}` references and cross-field rules are all collected as
`Problem(location, message, line)` so `commitgate policy check` can print them
at once. Cross-field rules read the raw document, so they still run when some
fields fail validation.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictBool,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from commitgate.server.ledger.urls import parse_ledger_url
from commitgate.server.model.durations import (
    DURATION_PATTERN,
    format_duration,
    parse_duration,
    parse_written_duration,
)
from commitgate.server.model.facts import REFERENCE, IdempotencyClass
from commitgate.server.model.outcomes import Outcome, Verdict
from commitgate.server.policy.approvals import ApprovalPolicy
from commitgate.server.policy.budgets import BudgetPolicy
from commitgate.server.policy.duplicates import DuplicatesPolicy, duplicates_shorthand

# Set in the validation context when a document is read from a file: durations must carry their unit.
FROM_FILE = {"written": True}


def _duration(value: Any, info: ValidationInfo) -> float:
    written = bool(info.context and info.context.get("written"))
    return parse_written_duration(value) if written else parse_duration(value)


def _dump_duration(seconds: float) -> str:
    text = format_duration(seconds)
    if parse_duration(text) == seconds:
        return text
    return f"{seconds:.6f}".rstrip("0").rstrip(".") + "s"


Duration = Annotated[
    float,
    BeforeValidator(_duration),
    PlainSerializer(_dump_duration, return_type=str, when_used="json"),
    WithJsonSchema(
        {"type": "string", "pattern": DURATION_PATTERN, "examples": ["250ms", "10s", "5m", "24h"]}
    ),
]
PositiveDuration = Annotated[Duration, Field(gt=0)]

# `${NAME}` or `${NAME:-default}` in any string of the file, resolved at load time.
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# `{arguments.X}` / `{result.X}` with nested paths, as the saga and http sources fill them.
_BRACED = re.compile(r"\{([A-Za-z_][A-Za-z0-9_\-]*)((?:\.[A-Za-z0-9_\-]*)*)\}")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
BUDGET_NAME = TOOL_NAME
RESERVED_TOOL_NAMES = frozenset({"get_operation_status", "list_operations", "compensate_session"})


_BARE_KEY = re.compile(r"[A-Za-z0-9_\-]+")


def toml_key(name: str) -> str:
    """A key as written in TOML: bare when it can be, quoted otherwise (`tools."send email"`)."""
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name, ensure_ascii=False)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class RetryPolicy(_Strict):
    """How failed attempts are retried (which failures are retried is decided by the class)."""

    attempts: int = Field(3, ge=1, le=100, description="All attempts, the first included.")
    initial: Duration = Field(0.1, description="Backoff before the second attempt.")
    max: Duration = Field(5.0, description="Largest backoff between two attempts.")
    multiplier: float = Field(2.0, ge=1.0, le=100.0, description="Growth of the backoff per attempt.")
    jitter: Literal["full", "none"] = Field(
        "full", description="`full` draws each backoff uniformly below its cap so retriers spread out."
    )
    deadline: PositiveDuration = Field(60.0, description="Time budget for one call, retries included.")

    @model_validator(mode="after")
    def _max_not_below_initial(self) -> RetryPolicy:
        if self.max < self.initial:
            raise ValueError("`max` must not be smaller than `initial`")
        return self


CALL_OUTCOMES = tuple(Outcome)  # what an HTTP status may mean for a call
CHECK_VERDICTS = tuple(Verdict)  # ... and for a status check
HttpOutcome: TypeAlias = Outcome | Verdict
HTTP_STATUS_PATTERN = re.compile(r"[1-5](\d\d|xx)")


class HttpRequestSpec(_Strict):
    """A request to a downstream HTTP API (httpx2)."""

    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = Field("POST", description="HTTP method.")
    url: str = Field(
        description="URL; may contain {arguments.X}, {idempotency_key} and {session}.",
        min_length=1,
    )
    key_header: str = Field(
        "Idempotency-Key", min_length=1, description="Header that carries the idempotency key downstream."
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="Extra headers; put secrets in ${ENV} references."
    )
    timeout: PositiveDuration | None = Field(None, description="Per-request timeout (default: the tool's).")
    body: Literal["json", "query", "none"] | None = Field(
        None,
        description="Where arguments not used in the URL go (default: json for POST/PUT/PATCH, else query).",
    )
    outcomes: dict[str, HttpOutcome] = Field(
        default_factory=dict,
        description="Per-status overrides of the default mapping, by code ('409') or class ('5xx'): "
        "success | retryable | ambiguous | permanent on a call; found | not_found | cannot_tell on a status check.",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https:// (got {url[:40]!r})")
        return url


class StatusCheckSpec(_Strict):
    """Asks the system of record whether an action took effect: its result, or nothing."""

    python: str | None = Field(
        None, description="'package.module:function' with the same parameters as the tool."
    )
    http: HttpRequestSpec | None = Field(
        None, description="2xx = found (body is the result), 404 = not found, else cannot tell."
    )

    @model_validator(mode="after")
    def _one_source(self) -> StatusCheckSpec:
        if (self.python is None) == (self.http is None):
            raise ValueError("a status check has exactly one of `python` or `http`")
        return self


def _status_check_shorthand(value: Any) -> Any:
    return {"python": value} if isinstance(value, str) else value


class CompensateSpec(_Strict):
    """The action that undoes a compensable tool's effect."""

    tool: str = Field(min_length=1, description="A keyed tool of this policy (often expose = false).")
    arguments: dict[str, Any] = Field(
        default_factory=dict,
        description="Its arguments; strings may refer to {arguments.X} and {result.X} of the forward call.",
    )


class ToolPolicy(_Strict):
    """One served tool: its idempotency class, exactly one source, and how it is guarded."""

    idempotency_class: IdempotencyClass = Field(
        alias="class", description="safe-retry | key-required | key-and-status-check | compensable"
    )
    python: str | None = Field(None, description="Source: 'package.module:function'.")
    http: HttpRequestSpec | None = Field(None, description="Source: a downstream HTTP API.")
    upstream: str | None = Field(None, description="Source: a tool of the MCP server [upstreams.NAME].")
    upstream_tool: str | None = Field(None, description="The upstream's tool name (default: this name).")
    input_schema: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments; required for http tools."
    )
    timeout: PositiveDuration = Field(30.0, description="Time limit of one attempt.")
    retry: RetryPolicy = Field(default_factory=lambda: RetryPolicy(), description="Retry schedule.")
    forwards_key: StrictBool = Field(
        False, description="The downstream dedups on the key, so an ambiguous failure may be retried."
    )
    status_check: Annotated[
        StatusCheckSpec | None,
        BeforeValidator(_status_check_shorthand, json_schema_input_type=str | StatusCheckSpec | None),
    ] = Field(None, description="Required for key-and-status-check; a string is short for {python = ...}.")
    compensate: CompensateSpec | None = Field(None, description="Required for compensable tools.")
    retention: Duration | None = Field(None, description="How long records are kept (default: [server]).")
    duplicates: Annotated[
        DuplicatesPolicy | None,
        BeforeValidator(duplicates_shorthand, json_schema_input_type=bool | DuplicatesPolicy),
    ] = Field(
        default_factory=DuplicatesPolicy,
        description="Keyed tools: catch the same call re-issued under a new key (default on, "
        "{window = '10m', scope = 'session', action = 'reject'}); false turns it off.",
    )
    approval: ApprovalPolicy | None = Field(
        None,
        description="Keyed tools: a person approves matching calls before they run "
        "({when = CEL, timeout = '24h', via = ['client', 'operator'], prompt = '...'}).",
    )
    budget: str | None = Field(
        None, min_length=1, description="Keyed tools: the [budgets.NAME] its calls spend from."
    )
    expose: StrictBool = Field(True, description="Listed to clients; false keeps it for compensations only.")
    destructive: StrictBool = Field(False, description="MCP destructiveHint for keyed tools.")
    title: str | None = Field(None, description="Human-readable title.")
    description: str | None = Field(None, description="Description for the model (default: the docstring).")

    @property
    def source_kind(self) -> str:
        return "python" if self.python else "http" if self.http else "upstream"

    @property
    def source_ref(self) -> str:
        """The source in one line, for tables and logs."""
        if self.python:
            return self.python
        if self.http:
            return f"{self.http.method} {self.http.url}"
        return f"{self.upstream}:{self.upstream_tool or ''}".rstrip(":")


class LimitsPolicy(_Strict):
    """Input limits; each answers with a clear error, none takes the server down."""

    max_argument_bytes: int = Field(
        1 << 20, ge=1, le=1 << 30, description="Largest arguments object, in bytes."
    )
    max_result_bytes: int = Field(
        4 << 20, ge=1, le=1 << 30, description="Largest result stored in the ledger."
    )
    list_limit: int = Field(200, ge=1, le=10_000, description="Most operations one list_operations returns.")
    max_concurrent_per_principal: int = Field(
        64, ge=1, le=100_000, description="Operations one principal may run."
    )


def _add_shorthand(schema: dict[str, Any]) -> None:
    schema["properties"]["max_argument_bytes"] = {
        "type": "integer",
        "minimum": 1,
        "description": "Shorthand for limits.max_argument_bytes.",
    }


class ServerPolicy(_Strict):
    """The server's identity, defaults and time limits."""

    model_config = ConfigDict(json_schema_extra=lambda schema: _add_shorthand(schema))

    name: str = Field("commitgate", min_length=1, description="MCP server name.")
    principal: str | None = Field(None, description="Principal of stdio callers (default: the OS user).")
    session: str = Field(
        "default", min_length=1, max_length=255, description="Session when a call names none."
    )
    retention: Duration = Field(86400.0, description="How long completed records are kept.")
    respond_within: PositiveDuration = Field(
        25.0, description="Answer operation_in_progress after this; the work continues."
    )
    in_progress_wait: Duration = Field(10.0, description="How long a duplicate call waits for the first.")
    lease: PositiveDuration = Field(10.0, description="Lease of a running attempt, renewed while it runs.")
    limits: LimitsPolicy = Field(default_factory=lambda: LimitsPolicy(), description="Input limits.")

    @model_validator(mode="before")
    @classmethod
    def _limits_shorthand(cls, data: Any) -> Any:
        # `[server] max_argument_bytes` is accepted as a shorthand; the value lives in `limits`.
        if isinstance(data, dict) and "max_argument_bytes" in data:
            data = dict(data)
            limits = data.get("limits", {})
            if isinstance(limits, dict):
                data["limits"] = {**limits, "max_argument_bytes": data.pop("max_argument_bytes")}
        return data


class LedgerPolicy(_Strict):
    """Where operations are recorded."""

    url: str | None = Field(
        None,
        description="sqlite:///relative.db, sqlite:////absolute.db or postgresql://...; default: a file "
        "in the user's state directory.",
    )
    synchronous: Literal["FULL", "NORMAL", "EXTRA"] = Field(
        "FULL", description="SQLite durability; FULL survives power loss."
    )
    durability: Literal["full", "claim"] = Field(
        "full",
        description="full: the claim and the outcome are on disk before the effect and before the answer. "
        "claim: the claim is on disk before the effect; the outcome is committed at once but synced by the "
        "next group commit, within outcome_sync_within (one disk sync less per call); a power loss in that "
        "window leaves the operation UNKNOWN, never executed twice.",
    )
    outcome_sync_within: PositiveDuration = Field(
        0.05,
        description='durability = "claim": the longest an outcome waits for its disk sync (default 50ms).',
    )
    auto_migrate: bool = Field(
        True,
        description="PostgreSQL: bring the ledger schema up to date at start-up (safe with several "
        "replicas starting at once). false: refuse to start until `commitgate ops migrate` has run.",
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        if url is not None:
            parse_ledger_url(url)  # ValueError names the accepted forms
        return url


class AuthToken(_Strict):
    """A bearer token for HTTP transports, never written in clear."""

    principal: str = Field(min_length=1, description="Who calls with this token.")
    token_env: str | None = Field(None, description="Name of an environment variable holding the token.")
    token_sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$", description="Hex SHA-256 digest of the token."
    )

    @field_validator("token_sha256", mode="before")
    @classmethod
    def _hex_digest(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.fullmatch(r"[0-9a-fA-F]{64}", value):
            raise ValueError("must be 64 hex digits: the SHA-256 of the token, e.g. from `sha256sum`")
        return value

    @model_validator(mode="after")
    def _one_secret(self) -> AuthToken:
        if (self.token_env is None) == (self.token_sha256 is None):
            raise ValueError("each token has exactly one of `token_env` or `token_sha256`")
        return self


class AuthPolicy(_Strict):
    """Bearer tokens of the HTTP transports."""

    tokens: list[AuthToken] = Field(default_factory=list, description="[[auth.tokens]] entries.")


class UpstreamPolicy(_Strict):
    """Another MCP server whose listed tools commitgate proxies."""

    command: str | None = Field(None, min_length=1, description="stdio: the command to start.")
    args: list[str] = Field(default_factory=list, description="stdio: its arguments.")
    env: dict[str, str] = Field(default_factory=dict, description="stdio: extra environment.")
    cwd: str | None = Field(None, description="stdio: working directory.")
    url: str | None = Field(None, min_length=1, description="HTTP: the server's URL.")
    transport: Literal["streamable-http", "sse"] = Field(
        "streamable-http", description="HTTP: the transport."
    )
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP: extra headers.")

    @model_validator(mode="after")
    def _one_target(self) -> UpstreamPolicy:
        if (self.command is None) == (self.url is None):
            raise ValueError("an upstream has exactly one of `command` or `url`")
        return self


class Policy(_Strict):
    """A commitgate policy file."""

    server: ServerPolicy = Field(default_factory=lambda: ServerPolicy(), description="[server]")
    ledger: LedgerPolicy = Field(default_factory=lambda: LedgerPolicy(), description="[ledger]")
    auth: AuthPolicy | None = Field(None, description="[auth] for HTTP transports.")
    upstreams: dict[str, UpstreamPolicy] = Field(default_factory=dict, description="[upstreams.NAME]")
    budgets: dict[str, BudgetPolicy] = Field(
        default_factory=dict, description="[budgets.NAME]: caps on what tools may spend."
    )
    tools: dict[str, ToolPolicy] = Field(default_factory=dict, description="[tools.NAME]")

    def retention_for(self, tool: str) -> float:
        """How long the tool's completed records are kept: at least its budget's window, so that
        everything the budget counts is still in the ledger when it adds it up."""
        policy = self.tools.get(tool)
        retention = policy.retention if policy and policy.retention is not None else self.server.retention
        budget = self.budget_of(tool)
        return max(retention, budget.window) if budget is not None else retention

    def budget_of(self, tool: str) -> BudgetPolicy | None:
        policy = self.tools.get(tool)
        if policy is None or policy.budget is None:
            return None
        return self.budgets.get(policy.budget)


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema of the policy file, for editors (`#:schema`) and validators."""
    schema = Policy.model_json_schema(mode="validation", by_alias=True)
    # Draft 7: what TOML language servers (taplo, Even Better TOML) support best; `$defs` is only
    # a place that `$ref` pointers lead to, which every draft resolves.
    return {"$schema": "http://json-schema.org/draft-07/schema#", **schema}


# --- problems --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Problem:
    location: str
    message: str
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        if not self.location:
            where = f"line {self.line}, column {self.column}: " if self.line and self.column else ""
            return f"{where}{self.message}"
        suffix = f" (line {self.line})" if self.line else ""
        return f"{self.location}: {self.message}{suffix}"

    def as_json(self) -> dict[str, Any]:
        return {"location": self.location, "message": self.message, "line": self.line, "column": self.column}


class PolicyError(Exception):
    """Every problem found in a policy; `str()` lists them one per line."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems))


def _location(loc: tuple[int | str, ...]) -> str:
    # pydantic reports union members and validator names in loc; keep only the path in the file.
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif "[" in part or part.startswith("function-"):
            continue
        else:
            text += f".{toml_key(part)}" if text else toml_key(part)
    return text


def _got(item: ErrorDetails) -> str:
    value = item.get("input")
    if isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= 40):
        return f" (got {value!r})"
    return ""


# What a value of the wrong type must be, by pydantic's error type.
_MUST_BE = {
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "must be an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "must be a number"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "must be true or false"),
    "string_type": "must be a string",
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), "must be a table"),
    "list_type": "must be an array",
}
_BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")


def _message(item: ErrorDetails) -> str:
    kind, ctx = item["type"], item.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown key" + _suggestion(item["loc"]) + " (see `commitgate policy schema`)"
    if kind == "missing":
        return "required key is missing"
    if kind in _BOUNDS:
        return _bound(kind, ctx) + _got(item)
    if kind in _MUST_BE:
        return _MUST_BE[kind] + _got(item)
    if kind in ("literal_error", "enum"):
        expected = str(ctx.get("expected", "one of the allowed values"))
        return (
            f"must be {expected}"
            + _got(item)
            + _closest(item.get("input"), re.findall(r"'([^']*)'", expected))
        )
    return item["msg"].removeprefix("Value error, ")


def _bound(kind: str, ctx: Mapping[str, Any]) -> str:
    names = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    op, key = names[kind]
    return f"must be {op} {ctx.get(key)}"


def _closest(given: Any, options: list[str]) -> str:
    if not isinstance(given, str):
        return ""
    close = difflib.get_close_matches(given, options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _suggestion(loc: tuple[int | str, ...]) -> str:
    unknown = loc[-1]
    known = _keys_at(loc[:-1])
    if not isinstance(unknown, str) or not known:
        return ""
    close = difflib.get_close_matches(unknown, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _keys_at(loc: tuple[int | str, ...]) -> list[str]:
    """The keys allowed at a location of the file, by walking the models."""
    current: Any = Policy
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = next(
                (f for n, f in current.model_fields.items() if part in (n, f.alias)),
                None,
            )
            if field is None:
                return []
            current = field.annotation
        elif typing.get_origin(current) in (dict, list):
            current = typing.get_args(current)[-1]
        else:
            return []
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or n for n, f in current.model_fields.items()]
    return []


def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
            tp = (models or members)[0]
        else:
            return tp


def _pydantic_problems(error: ValidationError, prefix: tuple[str, ...] = ()) -> list[Problem]:
    return [Problem(_location(prefix + tuple(item["loc"])), _message(item)) for item in error.errors()]


def _substitute_env(value: Any, location: str, problems: list[Problem]) -> Any:
    """Resolve `${NAME}` and `${NAME:-default}` in every string at load time."""
    if isinstance(value, dict):
        return {
            k: _substitute_env(v, f"{location}.{toml_key(k)}" if location else toml_key(k), problems)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_substitute_env(v, f"{location}[{i}]", problems) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:

        def resolve(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            problems.append(
                Problem(location, f"environment variable {name} is not set (or write ${{{name}:-default}})")
            )
            return ""

        return _ENV_REF.sub(resolve, value)
    return value


# --- cross-field rules, on the raw document ---------------------------------------


def _tables(value: Any) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in value.items() if isinstance(v, dict)} if isinstance(value, dict) else {}


def _class_of(raw: Mapping[str, Any]) -> IdempotencyClass | None:
    try:
        return IdempotencyClass(str(raw.get("class")))
    except ValueError:
        return None


def _cross_field_problems(data: Mapping[str, Any]) -> list[Problem]:
    tools = _tables(data.get("tools"))
    upstreams = data.get("upstreams") if isinstance(data.get("upstreams"), dict) else {}
    budgets = data.get("budgets") if isinstance(data.get("budgets"), dict) else {}
    problems: list[Problem] = []
    for name in budgets or {}:
        if not BUDGET_NAME.fullmatch(name):
            problems.append(
                Problem(
                    f"budgets.{toml_key(name)}",
                    "budget names are 1-128 characters of letters, digits, '_', '-', '.'",
                )
            )
    for name, raw in tools.items():
        problems += _tool_problems(name, raw, tools, upstreams or {})
        problems += _budget_problems(f"tools.{toml_key(name)}", raw, budgets or {})
    return problems


def _budget_problems(where: str, raw: Mapping[str, Any], budgets: Mapping[str, Any]) -> list[Problem]:
    """`budget = "NAME"` names a declared budget, on a keyed tool (only those are recorded)."""
    name = raw.get("budget")
    if not isinstance(name, str) or not name:
        return []
    problems = []
    if name not in budgets:
        close = difflib.get_close_matches(name, list(budgets), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        declared = f" (declared: {', '.join(map(repr, budgets))})" if budgets and not close else ""
        problems.append(Problem(f"{where}.budget", f"no [budgets.{name}] is declared{hint}{declared}"))
    if _class_of(raw) is IdempotencyClass.SAFE_RETRY:
        problems.append(
            Problem(
                f"{where}.budget",
                "safe-retry tools are not recorded, so nothing could be counted; only keyed tools spend a budget",
            )
        )
    return problems


def _tool_problems(
    name: str, raw: dict[str, Any], tools: dict[str, dict[str, Any]], upstreams: Mapping[str, Any]
) -> list[Problem]:
    where = f"tools.{toml_key(name)}"
    problems = _name_problems(name, where) + _source_problems(where, raw, upstreams)
    problems += _schema_problems(where, raw)
    problems += _class_problems(where, raw)
    if isinstance(raw.get("compensate"), dict):
        problems += _compensation_problems(name, raw, tools)
    if isinstance(raw.get("approval"), dict):
        problems += _approval_problems(where, raw)
    problems += _http_reference_problems(where, raw)
    problems += _http_outcome_problems(where, raw)
    return problems


def _name_problems(name: str, where: str) -> list[Problem]:
    problems = []
    if not TOOL_NAME.fullmatch(name):
        problems.append(Problem(where, "tool names are 1-128 characters of letters, digits, '_', '-', '.'"))
    if name in RESERVED_TOOL_NAMES:
        problems.append(Problem(where, f"{name!r} is the name of a commitgate meta tool; choose another"))
    return problems


def _source_problems(where: str, raw: Mapping[str, Any], upstreams: Mapping[str, Any]) -> list[Problem]:
    problems = []
    sources = [s for s in ("python", "http", "upstream") if raw.get(s) is not None]
    if len(sources) != 1:
        found = " and ".join(sources) or "none"
        problems.append(
            Problem(where, f"needs exactly one source: python, http or upstream (found: {found})")
        )
    upstream = raw.get("upstream")
    if isinstance(upstream, str) and upstream not in upstreams:
        problems.append(Problem(f"{where}.upstream", f"no [upstreams.{upstream}] is declared"))
    if raw.get("upstream_tool") is not None and upstream is None:
        problems.append(Problem(f"{where}.upstream_tool", "only meaningful with `upstream`"))
    return problems


def _class_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    """What the tool's class requires of the rest of its declaration, and what it rules out."""
    cls, problems = _class_of(raw), []
    if cls is IdempotencyClass.KEY_AND_STATUS_CHECK and raw.get("status_check") is None:
        problems.append(Problem(f"{where}.status_check", "class key-and-status-check needs a status_check"))
    if cls is IdempotencyClass.COMPENSABLE and raw.get("compensate") is None:
        problems.append(
            Problem(
                f"{where}.compensate", "class compensable needs compensate = {tool = ..., arguments = {...}}"
            )
        )
    if cls is not None and cls is not IdempotencyClass.COMPENSABLE and raw.get("compensate") is not None:
        problems.append(Problem(f"{where}.compensate", "only tools of class compensable declare compensate"))
    if cls is IdempotencyClass.SAFE_RETRY and raw.get("forwards_key") is True:
        problems.append(Problem(f"{where}.forwards_key", "safe-retry tools take no key to forward"))
    if cls is IdempotencyClass.SAFE_RETRY and raw.get("duplicates") not in (None, False):
        problems.append(
            Problem(
                f"{where}.duplicates",
                "safe-retry tools run again by design; only keyed tools detect duplicates",
            )
        )
    if cls is IdempotencyClass.SAFE_RETRY and raw.get("approval") is not None:
        problems.append(
            Problem(
                f"{where}.approval",
                "safe-retry tools are not recorded, so nothing can wait for a decision; only keyed tools "
                "take an approval",
            )
        )
    return problems


def _approval_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    """The prompt's `{arguments.X}` must name arguments of the tool; `{result.X}` does not exist yet."""
    prompt = raw["approval"].get("prompt")
    if not isinstance(prompt, str):
        return []
    problems: list[Problem] = []
    schema = raw.get("input_schema") if isinstance(raw.get("input_schema"), dict) else None
    for location, root, path in template_references(prompt, f"{where}.approval.prompt", problems):
        if root == "result":
            problems.append(Problem(location, "a prompt is shown before the call runs: only {arguments.X}"))
        elif schema is not None and (missing := missing_path(schema, path)) is not None:
            problems.append(Problem(location, f"the tool has no argument {missing}"))
    return problems


def _http_outcome_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    """A call's overrides name outcomes, a status check's name verdicts; the two are easy to swap."""
    status = raw.get("status_check")
    specs: list[tuple[str, Any, tuple[str, ...]]] = [(f"{where}.http", raw.get("http"), CALL_OUTCOMES)]
    if isinstance(status, dict):
        specs.append((f"{where}.status_check.http", status.get("http"), CHECK_VERDICTS))
    problems: list[Problem] = []
    for spec_where, spec, allowed in specs:
        outcomes = spec.get("outcomes") if isinstance(spec, dict) else None
        if not isinstance(outcomes, dict):
            continue
        for code, value in outcomes.items():
            if not HTTP_STATUS_PATTERN.fullmatch(code):
                problems.append(
                    Problem(
                        f"{spec_where}.outcomes.{toml_key(code)}",
                        "not an HTTP status: write a code like '409' or a class like '5xx'",
                    )
                )
            if (
                value in CALL_OUTCOMES + CHECK_VERDICTS and value not in allowed
            ):  # others: a type error already
                problems.append(
                    Problem(
                        f"{spec_where}.outcomes.{toml_key(code)}",
                        f"{value!r} does not apply here: use one of {', '.join(allowed)}",
                    )
                )
    return problems


def _schema_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    status = raw.get("status_check")
    if raw.get("python") is not None and isinstance(status, Mapping) and status.get("http") is not None:
        return [
            Problem(
                f"{where}.status_check",
                'a python tool\'s status check is python too (`status_check = "module:function"`)',
            )
        ]
    schema = raw.get("input_schema")
    if raw.get("http") is not None and schema is None:
        return [Problem(f"{where}.input_schema", "an http tool needs an input_schema (JSON Schema)")]
    if schema is not None and raw.get("python") is not None:
        return [
            Problem(f"{where}.input_schema", "python tools take their schema from the function's signature")
        ]
    if not isinstance(schema, dict):
        return []
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return [Problem(f"{where}.input_schema", f"not a valid JSON Schema: {exc.message}")]
    if schema.get("type", "object") != "object":
        return [Problem(f"{where}.input_schema.type", 'tool arguments are an object: type = "object"')]
    return []


def _compensation_problems(name: str, raw: dict[str, Any], tools: dict[str, dict[str, Any]]) -> list[Problem]:
    where = f"tools.{toml_key(name)}.compensate"
    spec = raw["compensate"]
    problems: list[Problem] = []
    target_name = spec.get("tool")
    if isinstance(target_name, str):
        target = tools.get(target_name)
        if target is None:
            close = difflib.get_close_matches(target_name, list(tools), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(Problem(f"{where}.tool", f"no tool named {target_name!r} in [tools]{hint}"))
        elif target_name == name:
            problems.append(Problem(f"{where}.tool", "a tool cannot compensate itself"))
        elif _class_of(target) is IdempotencyClass.SAFE_RETRY:
            problems.append(Problem(f"{where}.tool", "a compensating tool must be keyed (not safe-retry)"))
        elif target is not None and isinstance(target.get("input_schema"), dict):
            problems += argument_key_problems(where, spec.get("arguments"), target["input_schema"])
    arguments = spec.get("arguments")
    if isinstance(arguments, dict):
        forward_schema = raw.get("input_schema") if isinstance(raw.get("input_schema"), dict) else None
        for location, root, path in template_references(arguments, f"{where}.arguments", problems):
            if root == "arguments" and forward_schema is not None:
                missing = missing_path(forward_schema, path)
                if missing is not None:
                    problems.append(Problem(location, f"the forward call has no argument {missing}"))
    return problems


def _http_reference_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    schema = raw.get("input_schema")
    if not isinstance(schema, dict):
        return []
    problems: list[Problem] = []
    status = raw.get("status_check")
    for spec_where, spec in ((f"{where}.http", raw.get("http")), (f"{where}.status_check.http", None)):
        if spec is None and isinstance(status, dict):
            spec = status.get("http")
        if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
            continue
        problem = url_argument_problem(spec["url"], schema)
        if problem is not None:
            problems.append(Problem(f"{spec_where}.url", problem))
    return problems


def url_argument_problem(url: str, schema: Mapping[str, Any]) -> str | None:
    """The first `{arguments.X}` of an HTTP url that the tool's input schema certainly lacks, said
    as `policy check` says it. Sources ask too, for schemas only an upstream knows."""
    for match in REFERENCE.finditer(url):
        if match.group(1) == "arguments":
            missing = missing_path(schema, match.group(2).split(".")[1:])
            if missing is not None:
                return f"input_schema has no argument {missing}"
    return None


def template_references(
    value: Any, location: str, problems: list[Problem]
) -> Iterator[tuple[str, str, list[str]]]:
    """Every `{arguments.X}` / `{result.X}` in a template: (location, root, path); misspelt ones are problems."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from template_references(item, f"{location}.{toml_key(key)}", problems)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from template_references(item, f"{location}[{i}]", problems)
    elif isinstance(value, str):
        for match in _BRACED.finditer(value):
            head, path = match.group(1), match.group(2)
            reference = REFERENCE.fullmatch(match.group(0))
            if reference is not None:
                yield location, reference.group(1), reference.group(2).split(".")[1:]
            elif (
                head in ("arguments", "result")
                or path
                or difflib.get_close_matches(head, ["arguments", "result"], n=1, cutoff=0.75)
            ):
                problems.append(
                    Problem(
                        location,
                        f"bad reference {match.group(0)}: write {{arguments.NAME}} or {{result.NAME}} "
                        "(nested paths like {result.booking.id} are allowed)",
                    )
                )


def missing_path(
    schema: Mapping[str, Any], path: list[str], closed_top: bool = True, exhaustive: bool = False
) -> str | None:
    """The first part of `path` the JSON Schema certainly lacks (quoted), or None if it may exist.

    With `closed_top`, the top level lists every name (tool arguments do); with `exhaustive`,
    every level does (pydantic-validated values keep only the fields they declare).
    """
    root = schema
    node: Mapping[str, Any] = schema
    walked: list[str] = []
    for part in path:
        node = _resolve(root, node)
        walked.append(part)
        properties = node.get("properties")
        if isinstance(properties, dict) and part in properties:
            node = properties[part]
            continue
        items = node.get("items")
        if part.isdigit() and isinstance(items, dict):
            node = items
            continue
        if not isinstance(properties, dict):
            return None
        closed = node.get("additionalProperties", None)
        if closed is False or (closed is None and (exhaustive or (closed_top and len(walked) == 1))):
            return repr(".".join(walked))
        return None
    return None


def _resolve(root: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any]:
    """Follow local `$ref`s (pydantic puts nested models in `$defs`) and single-member anyOf."""
    for _ in range(20):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            target: Any = root
            for part in ref[2:].split("/"):
                target = target.get(part, {}) if isinstance(target, dict) else {}
            node = target
            continue
        options = [o for o in node.get("anyOf", []) if isinstance(o, dict) and o.get("type") != "null"]
        if "properties" not in node and len(options) == 1:
            node = options[0]
            continue
        return node
    return node


def argument_key_problems(where: str, arguments: Any, target_schema: Mapping[str, Any]) -> list[Problem]:
    """Compensation arguments against the compensating tool's schema: unknown and missing names."""
    if not isinstance(arguments, dict):
        return []
    properties = target_schema.get("properties")
    if not isinstance(properties, dict):
        return []
    problems = []
    closed = target_schema.get("additionalProperties") is False or "additionalProperties" not in target_schema
    for key in arguments:
        if key not in properties and key != "idempotency_key" and closed:
            problems.append(
                Problem(f"{where}.arguments.{toml_key(key)}", "the compensating tool has no such argument")
            )
    required = [r for r in target_schema.get("required", []) if r != "idempotency_key"]
    absent = [r for r in required if r not in arguments]
    if absent:
        problems.append(
            Problem(f"{where}.arguments", f"the compensating tool also needs: {', '.join(map(repr, absent))}")
        )
    return problems


# --- where in the file -------------------------------------------------------------

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_LINE = re.compile(
    r"^\s*((?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'))*)\s*="
)


def _dotted(text: str) -> list[str]:
    return [p.strip().strip("\"'") for p in re.findall(r"\"[^\"]*\"|'[^']*'|[^.]+", text)]


def key_lines(text: str) -> dict[str, int]:
    """Best effort: the line where each table and key of a TOML document is written."""
    lines: dict[str, int] = {}
    table: list[str] = []
    counts: dict[str, int] = {}
    in_string = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.count('"""') % 2 or line.count("'''") % 2:
            in_string = not in_string
            if not in_string:
                continue
        if in_string and '"""' not in line and "'''" not in line:
            continue
        header = _HEADER.match(line)
        if header:
            name = ".".join(toml_key(p) for p in _dotted(header.group(2)))
            if header.group(1) == "[[":
                index = counts.get(name, -1) + 1
                counts[name] = index
                name = f"{name}[{index}]"
            table = [name]
            lines.setdefault(name, number)
            continue
        key = _KEY_LINE.match(line)
        if key:
            path = ".".join([*table, *(toml_key(p) for p in _dotted(key.group(1)))])
            lines.setdefault(path, number)
    return lines


def with_lines(problems: list[Problem], text: str) -> list[Problem]:
    """Attach the line of the nearest written key to each located problem."""
    index = key_lines(text)
    located = []
    for problem in problems:
        line = problem.line
        if line is None and problem.location:
            path = problem.location
            while path and path not in index:
                cut = max(path.rfind("."), path.rfind("["))
                path = path[:cut] if cut > 0 else ""
            line = index.get(path)
        located.append(Problem(problem.location, problem.message, line, problem.column))
    return located


# --- loading -----------------------------------------------------------------------


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
        for name, raw in _tables((self.data or {}).get("tools")).items():
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


def _dedupe(problems: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))


def analyse_data(data: dict[str, Any], source: str = "<policy>", text: str | None = None) -> PolicyReport:
    problems: list[Problem] = []
    data = _substitute_env(data, "", problems)
    policy: Policy | None = None
    try:
        policy = Policy.model_validate(data, context=FROM_FILE)
    except ValidationError as exc:
        problems += _pydantic_problems(exc)
    problems = _dedupe(problems + _cross_field_problems(data))
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
