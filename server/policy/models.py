"""The policy file's models (docs/policy.md): every key, its type, its default and its own checks.

A model checks what one key or one table can tell alone. Rules between keys live in `rules.py`,
located problems in `problems.py`, reading a file in `loading.py`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    StrictBool,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from commitgate.server.ledger.urls import parse_ledger_url
from commitgate.server.model.durations import (
    DURATION_PATTERN,
    format_duration,
    parse_duration,
    parse_written_duration,
)
from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.model.outcomes import Outcome, Verdict
from commitgate.server.policy.approvals import ApprovalPolicy
from commitgate.server.policy.budgets import BudgetPolicy
from commitgate.server.policy.duplicates import DuplicatesPolicy, duplicates_shorthand
from commitgate.server.policy.evidence import ConsolePolicy, NotifyPolicy, ReceiptsPolicy
from commitgate.server.policy.oauth import OAuthPolicy

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


HttpOutcome: TypeAlias = Outcome | Verdict


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

    principal: str = Field(
        min_length=1,
        description="Who calls with this token (an agent), or the operator's name recorded on decisions.",
    )
    role: Literal["agent", "operator"] = Field(
        "agent",
        description="'agent': calls MCP, nothing else. 'operator': signs in to the console and reads"
        " /metrics; refused on MCP.",
    )
    principals: list[str] | Literal["*"] | None = Field(
        None,
        description='Operator tokens: the principals whose operations it sees and decides (default "*":'
        " every principal).",
    )
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
        if self.principals is not None and self.role != "operator":
            raise ValueError('`principals` is for operator tokens only (add role = "operator")')
        if self.principals == []:
            raise ValueError('`principals` lists at least one principal, or is "*" for every principal')
        return self

    @property
    def sees(self) -> frozenset[str] | None:
        """The principals an operator token sees; None: every principal."""
        if self.principals is None or self.principals == "*" or "*" in self.principals:
            return None
        return frozenset(self.principals)


class AuthPolicy(_Strict):
    """Bearer tokens of the HTTP transports: static ones, and those of an identity provider."""

    tokens: list[AuthToken] = Field(default_factory=list, description="[[auth.tokens]] entries.")
    oauth: OAuthPolicy | None = Field(None, description="[auth.oauth]: tokens from an identity provider.")


class UpstreamPolicy(_Strict):
    """Another MCP server whose listed tools commitgate proxies."""

    command: str | None = Field(None, min_length=1, description="stdio: the command to start.")
    args: list[str] = Field(default_factory=list, description="stdio: its arguments.")
    env: dict[str, str] = Field(default_factory=dict, description="stdio: extra environment.")
    inherit_env: list[str] | Literal["*"] = Field(
        default_factory=list,
        description="stdio: variables of serve's own environment it also gets, beside the MCP SDK's "
        'safe defaults (PATH, HOME...) and `env`; "*" for all of them.',
    )
    cwd: str | None = Field(None, description="stdio: working directory.")
    url: str | None = Field(None, min_length=1, description="HTTP: the server's URL.")
    transport: Literal["streamable-http", "sse"] = Field(
        "streamable-http", description="HTTP: the transport."
    )
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP: extra headers.")
    tools: Literal["listed", "all"] = Field(
        "listed",
        description="listed: only tools with a [tools.X] entry are served. all: every tool it offers, "
        "including tools it adds later; a tool without an entry gets the class its annotations give "
        "(readOnlyHint: true => safe-retry, else key-required) or `default_class`.",
    )
    default_class: IdempotencyClass | None = Field(
        None,
        description='tools = "all": the class of its tools that have no entry, instead of the one their '
        "annotations give (safe-retry or key-required).",
    )
    connect_timeout: PositiveDuration = Field(
        60.0, description="Bound of one connection attempt (first start of `npx -y`/`uvx` may be slow)."
    )
    sessions: Literal["shared", "per-client"] = Field(
        "shared",
        description="shared: one upstream session for every client. per-client: the tool calls of each "
        "client session go through an upstream session of its own, opened at its first call and closed "
        "with it (stateful servers, several principals).",
    )

    # Variables its `env` or `headers` name that are not set: this upstream cannot start (set by loading).
    _unset_env: tuple[str, ...] = PrivateAttr(default=())

    @property
    def unset_env(self) -> tuple[str, ...]:
        return self._unset_env

    @property
    def unset_reason(self) -> str | None:
        """Why it cannot start, when its `env` or `headers` name variables that are not set."""
        names = self._unset_env
        if not names:
            return None
        if len(names) == 1:
            return f"environment variable {names[0]} is not set"
        return f"environment variables {', '.join(names)} are not set"

    def mark_unset(self, names: list[str]) -> None:
        self._unset_env = tuple(names)

    @model_validator(mode="after")
    def _one_target(self) -> UpstreamPolicy:
        if (self.command is None) == (self.url is None):
            raise ValueError("an upstream has exactly one of `command` or `url`")
        if self.default_class is not None and self.tools != "all":
            raise ValueError('`default_class` is only used with `tools = "all"`')
        if self.url is not None and self.inherit_env:
            raise ValueError(
                "`inherit_env` is for a `command` (stdio) upstream: commitgate starts no process for a `url`"
            )
        return self

    @field_validator("default_class")
    @classmethod
    def _class_without_declarations(cls, value: IdempotencyClass | None) -> IdempotencyClass | None:
        if value in (IdempotencyClass.KEY_AND_STATUS_CHECK, IdempotencyClass.COMPENSABLE):
            raise ValueError(
                f"{value.value} needs a status_check or compensate of its own: give such tools a "
                "[tools.X] entry; default_class is safe-retry or key-required"
            )
        return value


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
    receipts: ReceiptsPolicy = Field(default_factory=lambda: ReceiptsPolicy(), description="[receipts]")
    notify: list[NotifyPolicy] = Field(default_factory=list, description="[[notify]] webhooks.")
    console: ConsolePolicy = Field(default_factory=lambda: ConsolePolicy(), description="[console]")

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
