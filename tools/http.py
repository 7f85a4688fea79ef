"""`http = {...}`: a downstream HTTP API, called with httpx2 through one pooled client per server.

Policy shape (docs/policy.md#http-tools):

    [tools.create_refund]
    class = "key-and-status-check"
    input_schema = { type = "object", properties = { charge = { type = "string" } }, required = ["charge"] }
    http = { method = "POST", url = "https://api.example.com/v1/refunds", headers = { Authorization = "Bearer ${TOKEN}" } }
    status_check = { http = { url = "https://api.example.com/v1/refunds?idempotency_key={idempotency_key}" } }

* URL placeholders: `{arguments.X}` (also `{arguments.X.Y}`), `{idempotency_key}`, `{session}`; values are
  URL-encoded. Arguments not used in the URL travel as a JSON body (POST/PUT/PATCH) or as query
  parameters (GET/DELETE); `body = "json" | "query" | "none"` overrides. A status check sends no
  arguments unless it says `body = ...`, and its method defaults to GET.
* The key travels in `key_header` (default `Idempotency-Key`) on the call, not on the status check
  unless the check sets `key_header` itself. A status check without `headers` sends the tool's.
* Outcomes: connect/DNS/pool failures, 429 and 503 are retryable (honouring `Retry-After`, seconds or an
  HTTP date); read/write timeouts, dropped connections, other 5xx (and 1xx/3xx) are ambiguous; other
  4xx are permanent, the response body kept as the error's detail. A 2xx JSON object becomes
  structured content plus text; any other body becomes text.
* Status checks over HTTP: 2xx = found (the body is the result), 404 = certainly not found, anything
  else = cannot tell.
* Per-status overrides: `outcomes = { "404" = "success", "500" = "retryable", ... }` on the request
  spec, by code or class ("5xx"; a code wins): `success`, `retryable`, `ambiguous`, `permanent` on a
  call; `found`, `not_found`, `cannot_tell` on a status check. Declaring an ambiguous status
  retryable says the API answers it only before acting: commitgate then retries it with the key.

Header values (secrets come in as `${ENV}`) and resolved URLs (argument values) are never logged.
"""

from __future__ import annotations

import email.utils
import functools
import inspect
import json
import logging
import re
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, urlsplit

import anyio.to_thread
import httpx2

from commitgate.server.model import traces
from commitgate.server.model.context import OperationContext
from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.model.outcomes import AmbiguousError, Outcome, PermanentError, RetryableError, Verdict
from commitgate.server.model.records import ToolResult
from commitgate.server.policy.models import HttpRequestSpec, Policy, StatusCheckSpec, ToolPolicy
from commitgate.server.policy.rules import url_argument_problem
from commitgate.tools.base import Collaborators, DeclarationError, InvalidArguments
from commitgate.tools.python import load_callable

if TYPE_CHECKING:
    import jsonschema

log = logging.getLogger("commitgate.tools.http")

# httpx2 logs every request URL at INFO (query strings may carry argument values or `${ENV}` secrets)
# and httpcore2 traces at DEBUG: keep both quiet unless a user asks for them by name.
for _name in ("httpx2", "httpcore2"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.WARNING)


CONNECT_TIMEOUT = 5.0  # connecting is never slower than this on a healthy path; failing it is retryable
MAX_DETAIL_CHARS = 4000
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.\-]*)\}")


# --- the pooled client ---------------------------------------------------------------------------


def pooled_client() -> httpx2.AsyncClient:
    """The client a server lends its http sources (see Collaborators); timeouts are set per request."""
    return _PooledClient(
        timeout=httpx2.Timeout(30.0, connect=CONNECT_TIMEOUT),  # never httpx2's 5 s default read
        limits=httpx2.Limits(max_connections=100, max_keepalive_connections=20),
        follow_redirects=False,  # a redirected POST would be a second request nobody declared
    )


class _PooledClient(httpx2.AsyncClient):
    """httpx2's client whose connection pool is built when its first request goes out: the pool's TLS
    context reads the system's trust store, which with httpcore2's import is some 35 ms of every
    server start, and most servers never send a request. Proxies from the environment are mounted
    as httpx2 mounts them."""

    def _init_transport(self, *args: Any, **kwargs: Any) -> httpx2.AsyncBaseTransport:
        build = super()._init_transport
        return _OnFirstRequest(lambda: build(*args, **kwargs))


class _OnFirstRequest(httpx2.AsyncBaseTransport):
    def __init__(self, build: Callable[[], httpx2.AsyncBaseTransport]) -> None:
        self._build = build
        self._built: httpx2.AsyncBaseTransport | None = None

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self._built is None:  # no await before it is set: one pool, however many requests start
            self._built = self._build()
        return await self._built.handle_async_request(request)

    async def aclose(self) -> None:
        if self._built is not None:
            await self._built.aclose()


def _client(using: Collaborators, where: str) -> httpx2.AsyncClient:
    if using.http is None:  # built to be checked (policy check), never to be called
        raise RetryableError(f"{where}: this server has no HTTP client; the request was not sent")
    return using.http


# --- requests ------------------------------------------------------------------------------------


def _encode(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _dig(arguments: Mapping[str, Any], path: list[str]) -> Any:
    value: Any = arguments
    for part in path:
        if not isinstance(value, Mapping) or part not in value:
            raise InvalidArguments(f"{'.'.join(path)}: required by the URL but not given")
        value = value[part]
    return value


def _query_params(arguments: Mapping[str, Any]) -> list[tuple[str, str | int | float | bool | None]]:
    params: list[tuple[str, str | int | float | bool | None]] = []
    for name, value in arguments.items():
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        params.extend((name, _encode(item)) for item in items)
    return params


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request as declared in the policy, ready to be filled with a call's arguments."""

    method: str
    url: str
    headers: Mapping[str, str]
    key_header: str | None
    body: Literal["json", "query", "none"]
    timeout: float
    outcomes: Mapping[str, Outcome | Verdict]

    @classmethod
    def from_spec(
        cls,
        spec: HttpRequestSpec,
        timeout: float,
        *,
        status_check: bool,
        where: str,
        keyed: bool,
        default_headers: Mapping[str, str] | None = None,
    ) -> Request:
        explicit = spec.model_fields_set
        method = spec.method if (not status_check or "method" in explicit) else "GET"
        default_body: Literal["json", "query", "none"] = "json" if method in _BODY_METHODS else "query"
        body = spec.body or ("none" if status_check else default_body)
        key_header = spec.key_header if (not status_check or "key_header" in explicit) else None
        request = cls(
            method=method,
            url=spec.url,
            headers=dict(spec.headers if "headers" in explicit else (default_headers or {})),
            key_header=key_header if keyed else None,
            body=body,
            timeout=min(spec.timeout or timeout, timeout),
            outcomes=dict(spec.outcomes),
        )
        request._check(where, keyed)
        return request

    def _check(self, where: str, keyed: bool) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise DeclarationError(f"{where}.url", "an absolute http:// or https:// URL is needed")
        for match in _PLACEHOLDER.finditer(self.url):
            name = match.group(1)
            if name == "idempotency_key" and not keyed:
                raise DeclarationError(
                    f"{where}.url", "safe-retry tools have no idempotency_key to put in the URL"
                )
            if name not in ("idempotency_key", "session") and not name.startswith("arguments."):
                raise DeclarationError(
                    f"{where}.url",
                    f"unknown placeholder {{{name}}} (use {{arguments.NAME}}, {{idempotency_key}} or {{session}})",
                )

    @property
    def target(self) -> str:
        """Host and port only: what logs and messages may show of the URL."""
        return urlsplit(self.url).netloc.rpartition("@")[2]

    def url_arguments(self) -> set[str]:
        return {
            m.group(1).split(".")[1]
            for m in _PLACEHOLDER.finditer(self.url)
            if m.group(1).startswith("arguments.")
        }

    def filled_url(self, arguments: Mapping[str, Any], key: str | None, session: str) -> str:
        """The URL with each placeholder's value encoded in its place. A value can never leave its
        path segment: "/" is encoded, and a segment a value makes "." or ".." (which clients and
        servers resolve as "here" and "one level up") is refused with InvalidArguments."""

        def fill(match: re.Match[str]) -> str:
            name = match.group(1)
            if name == "idempotency_key":
                value: Any = key or ""
            elif name == "session":
                value = session
            else:
                value = _dig(arguments, name.split(".")[1:])
            return quote(_encode(value), safe="")

        cut = min((i for i in (self.url.find("?"), self.url.find("#")) if i >= 0), default=len(self.url))
        path, tail = self.url[:cut], self.url[cut:]  # the path, then its query and fragment
        segments = []
        for segment in path.split("/"):
            filled = _PLACEHOLDER.sub(fill, segment)
            if filled in (".", "..") and filled != segment:
                names = ", ".join(f"{{{m.group(1)}}}" for m in _PLACEHOLDER.finditer(segment))
                raise InvalidArguments(
                    f"{names}: {filled!r} cannot be a segment of the URL's path (it would name another"
                    " resource); pass the identifier itself"
                )
            segments.append(filled)
        return "/".join(segments) + _PLACEHOLDER.sub(fill, tail)

    def build(
        self, arguments: Mapping[str, Any], ctx: OperationContext, client: httpx2.AsyncClient
    ) -> httpx2.Request:
        url = self.filled_url(arguments, ctx.idempotency_key, ctx.session)
        rest = {k: v for k, v in arguments.items() if k not in self.url_arguments()}
        headers = dict(self.headers)
        if self.key_header and ctx.idempotency_key:
            headers[self.key_header] = ctx.idempotency_key
        traces.inject(headers)  # `traceparent` when tracing is on: the downstream joins the trace
        timeout = httpx2.Timeout(self.timeout, connect=min(CONNECT_TIMEOUT, self.timeout))
        if self.body == "json":
            return client.build_request(self.method, url, headers=headers, json=rest, timeout=timeout)
        target = httpx2.URL(url)
        if self.body == "query" and rest:  # merged into the URL's own query, which `params=` would replace
            target = target.copy_merge_params(_query_params(rest))
        return client.build_request(self.method, target, headers=headers, timeout=timeout)

    async def send(
        self, arguments: Mapping[str, Any], ctx: OperationContext, tool: str, using: Collaborators
    ) -> httpx2.Response:
        client = _client(using, f"{self.method} {self.target}")
        try:
            request = self.build(arguments, ctx, client)
        except InvalidArguments as exc:  # names the placeholder, never the URL's values
            raise PermanentError(f"{self.method} {self.target}: {exc}; nothing was sent") from exc
        except (httpx2.InvalidURL, ValueError) as exc:  # the message may hold the URL
            raise PermanentError(f"{self.method} {self.target}: the request could not be built") from exc
        started = time.monotonic()
        try:
            response = await client.send(request)
        except httpx2.HTTPError as exc:
            log.debug("%s: %s %s failed: %s", tool, self.method, self.target, type(exc).__name__)
            raise transport_outcome(exc, f"{self.method} {self.target}") from exc
        log.debug(
            "%s: %s %s -> %d in %.0f ms",
            tool,
            self.method,
            self.target,
            response.status_code,
            (time.monotonic() - started) * 1000,
        )
        return response

    def classify(self, status: int) -> Outcome | Verdict | None:
        """The override for this status (`"404"`, then `"4xx"`), or None for the default mapping."""
        return self.outcomes.get(str(status)) or self.outcomes.get(f"{status // 100}xx")


# --- outcomes ------------------------------------------------------------------------------------


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` as seconds from now: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def transport_outcome(exc: httpx2.HTTPError, what: str) -> Exception:
    """A transport failure as one of the three outcomes: was the request certainly not sent?"""
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout | httpx2.PoolTimeout):
        return RetryableError(f"{what}: could not connect ({reason}); the request was not sent")
    if isinstance(exc, httpx2.UnsupportedProtocol | httpx2.LocalProtocolError):
        return PermanentError(f"{what}: the request could not be built ({reason})")
    if isinstance(exc, httpx2.TimeoutException):
        return AmbiguousError(f"{what}: no answer in time ({type(exc).__name__}); it may have been applied")
    return AmbiguousError(f"{what}: the connection failed mid-request ({reason}); it may have been applied")


def _detail(response: httpx2.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:MAX_DETAIL_CHARS]


def _message_of(detail: Any) -> str:
    """The API's own words, when its error body follows a common shape."""
    if isinstance(detail, dict):
        error = detail.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if isinstance(detail.get(key), str):
                return str(detail[key])
    if isinstance(detail, str) and detail.strip():
        return detail.strip()[:300]
    return ""


def _default_outcome(status: int) -> Outcome:
    if 200 <= status < 300:
        return Outcome.SUCCESS
    if status in (429, 503):
        return Outcome.RETRYABLE
    if 400 <= status < 500:
        return Outcome.PERMANENT
    return Outcome.AMBIGUOUS  # other 5xx, and 1xx/3xx answers nobody asked for


def result_of(response: httpx2.Response) -> ToolResult:
    if not response.content:
        return ToolResult(content=[{"type": "text", "text": f"HTTP {response.status_code} (no body)"}])
    try:
        body = response.json()
    except ValueError:
        return ToolResult(content=[{"type": "text", "text": response.text}])
    if isinstance(body, dict):
        return ToolResult.of(body)
    return ToolResult(content=[{"type": "text", "text": response.text}])


def outcome_of(response: httpx2.Response, request: Request) -> ToolResult:
    """The tool's result for a 2xx answer; raise the outcome of any other."""
    status = response.status_code
    outcome = request.classify(status) or _default_outcome(status)
    if outcome == Outcome.SUCCESS:
        return result_of(response)
    detail = _detail(response)
    said = _message_of(detail)
    message = f"{request.method} {request.target} answered HTTP {status}" + (f": {said}" if said else "")
    retry_after = retry_after_seconds(response.headers.get("Retry-After"))
    if outcome == Outcome.RETRYABLE:
        raise RetryableError(message, retry_after=retry_after, detail=detail)
    if outcome == Outcome.PERMANENT:
        raise PermanentError(message, detail=detail)
    raise AmbiguousError(message + "; it may have been applied", retry_after=retry_after, detail=detail)


def check_outcome(response: httpx2.Response, request: Request) -> ToolResult | None:
    status = response.status_code
    verdict = request.classify(status)
    if not verdict:
        verdict = (
            Verdict.FOUND
            if 200 <= status < 300
            else Verdict.NOT_FOUND
            if status == 404
            else Verdict.CANNOT_TELL
        )
    if verdict == Verdict.FOUND:
        return result_of(response)
    if verdict == Verdict.NOT_FOUND:
        return None
    raise RuntimeError(f"status check {request.method} {request.target} answered HTTP {status}: cannot tell")


# --- validation ----------------------------------------------------------------------------------


class SchemaValidator:
    """jsonschema validation whose message names each failing field."""

    def __init__(self, schema: Mapping[str, Any], where: str) -> None:
        # Imported here: about 35 ms of every server start-up, for policies most of which declare
        # no schema tool (jsonschema brings referencing, attrs and rpds with it).
        import jsonschema.validators

        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise DeclarationError(where, f"not a valid JSON Schema: {exc.message}") from None
        self._validator = cls(schema)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if errors:
            raise InvalidArguments("; ".join(_describe(e) for e in errors[:5]))
        return arguments


def _describe(error: jsonschema.ValidationError) -> str:
    field = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "additionalProperties":
        return (
            f"{field or '(arguments)'}: {error.message.replace('Additional properties', 'unknown arguments')}"
        )
    return f"{field}: {error.message}" if field else error.message


# --- status checks -------------------------------------------------------------------------------


class StatusCheck(typing.Protocol):
    async def __call__(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None: ...


class HttpStatusCheck:
    def __init__(self, request: Request, tool: str, using: Collaborators) -> None:
        self.request, self.tool, self._using = request, tool, using

    async def __call__(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        response = await self.request.send(arguments, ctx, self.tool, self._using)
        return check_outcome(response, self.request)


class PythonStatusCheck:
    """`status_check = {python = "module:function"}` for a tool whose arguments are a JSON object:
    the function gets the arguments it names as keywords (all of them with `**kwargs`) and, if it
    asks for one, the `OperationContext`."""

    def __init__(self, ref: str, properties: set[str] | None, where: str) -> None:
        self.fn = load_callable(ref)
        signature = inspect.signature(self.fn)
        try:
            hints = typing.get_type_hints(self.fn)
        except Exception as exc:
            raise DeclarationError(where, f"cannot resolve the type hints of {ref}: {exc}") from exc
        self.context_param = next((n for n in signature.parameters if hints.get(n) is OperationContext), None)
        self.names = [
            n
            for n, p in signature.parameters.items()
            if n != self.context_param and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        self.takes_all = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        unknown = sorted(set(self.names) - properties) if properties is not None else []
        if unknown:
            raise DeclarationError(
                where, f"{ref} takes {', '.join(unknown)}, which the tool's arguments lack"
            )

    async def __call__(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        kwargs = (
            dict(arguments) if self.takes_all else {n: arguments[n] for n in self.names if n in arguments}
        )
        if self.context_param is not None:
            kwargs[self.context_param] = ctx
        if inspect.iscoroutinefunction(self.fn):
            found = await self.fn(**kwargs)
        else:
            found = await anyio.to_thread.run_sync(functools.partial(self.fn, **kwargs))
        return None if found is None else ToolResult.of(found)


def status_check_for(
    name: str,
    spec: StatusCheckSpec | None,
    policy: ToolPolicy,
    properties: set[str] | None,
    using: Collaborators,
) -> StatusCheck | None:
    """The status check a policy entry declares (python or http), for schema-described tools."""
    if spec is None:
        return None
    where = f"tools.{name}.status_check"
    if spec.http is not None:
        keyed = policy.idempotency_class.keyed
        request = Request.from_spec(
            spec.http,
            policy.timeout,
            status_check=True,
            where=f"{where}.http",
            keyed=keyed,
            default_headers=policy.http.headers if policy.http is not None else None,
        )
        _check_url_arguments(request, properties, f"{where}.http.url")
        return HttpStatusCheck(request, name, using)
    assert spec.python is not None
    return PythonStatusCheck(spec.python, properties, f"{where}.python")


def _check_url_arguments(request: Request, properties: set[str] | None, where: str) -> None:
    """The policy's rule (url_argument_problem), for tools whose properties are known only now."""
    if properties is None:
        return
    schema = {"type": "object", "properties": {key: {} for key in properties}}
    problem = url_argument_problem(request.url, schema)
    if problem is not None:
        raise DeclarationError(where, problem)


# --- the source ----------------------------------------------------------------------------------


class HttpTool:
    """A ToolSource calling one HTTP endpoint; see the module docstring for the policy shape."""

    def __init__(self, name: str, policy: ToolPolicy, whole: Policy, using: Collaborators) -> None:
        if policy.http is None:
            raise DeclarationError(f"tools.{name}", "no `http` request declared")
        if policy.input_schema is None:
            raise DeclarationError(
                f"tools.{name}.input_schema", "an http tool needs an input_schema (JSON Schema)"
            )
        self.name = name
        keyed = policy.idempotency_class is not IdempotencyClass.SAFE_RETRY
        self.request = Request.from_spec(
            policy.http, policy.timeout, status_check=False, where=f"tools.{name}.http", keyed=keyed
        )
        self.input_schema = _closed_schema(policy.input_schema)
        self.output_schema: dict[str, Any] | None = None
        self.description = policy.description or f"{self.request.method} request to {self.request.target}"
        self._validator = SchemaValidator(self.input_schema, f"tools.{name}.input_schema")
        properties = set(self.input_schema.get("properties", {}))
        _check_url_arguments(self.request, properties, f"tools.{name}.http.url")
        _check_url_arguments_required(self.request, self.input_schema, f"tools.{name}.http.url")
        self._using = using
        self._status = status_check_for(name, policy.status_check, policy, properties, using)
        self.has_status_check = self._status is not None

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        valid = self._validator.validate(arguments)
        self.request.filled_url(valid, "key", "session")  # a value that would leave its URL segment
        return valid

    async def call(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult:
        response = await self.request.send(arguments, ctx, self.name, self._using)
        return outcome_of(response, self.request)

    async def status(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        if self._status is None:
            raise RuntimeError(f"tools.{self.name} declares no status check")
        return await self._status(arguments, ctx)


def _closed_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Unknown arguments would travel to the API unnoticed: refuse them unless the schema allows them."""
    closed = json.loads(json.dumps(schema))
    closed.setdefault("type", "object")
    closed.setdefault("additionalProperties", False)
    return typing.cast(dict[str, Any], closed)


def _check_url_arguments_required(request: Request, schema: Mapping[str, Any], where: str) -> None:
    optional = sorted(request.url_arguments() - set(schema.get("required", [])))
    if optional:
        raise DeclarationError(
            where, f"{{arguments.{optional[0]}}} is used in the URL, so it must be required"
        )
