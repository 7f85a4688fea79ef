"""The http source: a REST API wrapped by editing the policy alone.

End to end: a real `commitgate serve` process (stdio, debug logging) in front of the sandbox payments
API (its own process and SQLite store, which is what gets counted); one of each for the module, each
test with keys of its own. Unit level: request building and
the status/transport → outcome mapping on real httpx2 objects.
"""

from __future__ import annotations

import contextlib
import email.utils
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.types import CallToolResult
from support.wrapping import call, error_code, operation, serve

from commitgate.server.demo.payments_api import SandboxProcess
from commitgate.server.model.context import OperationContext
from commitgate.server.model.outcomes import AmbiguousError, Outcome, PermanentError, RetryableError, Verdict
from commitgate.server.model.records import ToolResult
from commitgate.server.policy.loading import loads_policy
from commitgate.server.policy.problems import PolicyError
from commitgate.server.serve.registry import build_tools
from commitgate.tools.base import Collaborators, ToolBuildError
from commitgate.tools.http import (
    HttpTool,
    Request,
    outcome_of,
    pooled_client,
    retry_after_seconds,
    transport_outcome,
)

TOKEN = "sk_test_d0n7_l0g_m3_8c1f"  # the secret that must never reach a log
CARD = "4242424242424242"
DECLINED = "4000000000000002"

CHARGE_SCHEMA = (
    'input_schema = { type = "object", properties = { amount_cents = { type = "integer", minimum = 1 }, '
    'card = { type = "string" }, description = { type = "string" } }, required = ["amount_cents", "card"] }'
)
FAST_RETRY = 'retry = { attempts = 3, initial = "1ms", max = "10ms" }'
AUTH = 'headers = { Authorization = "Bearer ${PAYMENTS_TOKEN}" }'
WRONG_AUTH = 'headers = { Authorization = "Bearer ${PAYMENTS_WRONG_TOKEN}" }'
SERVER_ENV = {"PAYMENTS_TOKEN": TOKEN, "PAYMENTS_WRONG_TOKEN": "sk_wrong"}


def policy_text(url: str, ledger: Path) -> str:
    return f"""
[server]
lease = "5s"
respond_within = "20s"

[ledger]
url = "sqlite:///{ledger}"

[tools.charge_forwarding]
class = "key-required"
forwards_key = true
description = "Charge a card."
{CHARGE_SCHEMA}
http = {{ method = "POST", url = "{url}/v1/charges", {AUTH}, timeout = "3s" }}
{FAST_RETRY}

[tools.charge_plain]
class = "key-required"
{CHARGE_SCHEMA}
http = {{ method = "POST", url = "{url}/v1/charges", {AUTH}, timeout = "3s" }}
{FAST_RETRY}

[tools.charge_checked]
class = "key-and-status-check"
{CHARGE_SCHEMA}
http = {{ method = "POST", url = "{url}/v1/charges", {AUTH}, timeout = "600ms" }}
status_check = {{ http = {{ url = "{url}/v1/charges?idempotency_key={{idempotency_key}}" }} }}
{FAST_RETRY}

[tools.charge_500_before_acting]
class = "key-required"
description = "Charge a card on an API that answers 500 only before it acts."
{CHARGE_SCHEMA}
http = {{ method = "POST", url = "{url}/v1/charges", {AUTH}, timeout = "3s", outcomes = {{ "500" = "retryable" }} }}
{FAST_RETRY}

[tools.charge_wrong_token]
class = "key-required"
forwards_key = true
{CHARGE_SCHEMA}
http = {{ method = "POST", url = "{url}/v1/charges", {WRONG_AUTH}, timeout = "3s" }}
{FAST_RETRY}

[tools.refund_charge]
class = "key-required"
input_schema = {{ type = "object", properties = {{ charge = {{ type = "string" }}, amount_cents = {{ type = "integer" }} }}, required = ["charge", "amount_cents"] }}
http = {{ method = "POST", url = "{url}/v1/charges/{{arguments.charge}}/refunds", {AUTH}, timeout = "3s" }}

[tools.get_charge]
class = "safe-retry"
input_schema = {{ type = "object", properties = {{ id = {{ type = "string" }} }}, required = ["id"] }}
http = {{ method = "GET", url = "{url}/v1/charges/{{arguments.id}}", {AUTH} }}
{FAST_RETRY}
"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxProcess]:
    root = tmp_path_factory.mktemp("payments")
    with SandboxProcess(
        root / "payments.db", "--token-env", "PAYMENTS_TOKEN", env={"PAYMENTS_TOKEN": TOKEN}
    ) as api:
        yield api


@dataclass
class Gateway:
    """The `commitgate serve` process the end-to-end tests share (each with keys of its own)."""

    client: Client
    stderr: Path
    ledger: Path


@pytest.fixture(scope="module")
async def gateway(
    tmp_path_factory: pytest.TempPathFactory, sandbox: SandboxProcess, anyio_backend: str
) -> AsyncIterator[Gateway]:
    root = tmp_path_factory.mktemp("gateway")
    policy, stderr, ledger = root / "policy.toml", root / "stderr.log", root / "ledger.db"
    policy.write_text(policy_text(sandbox.url, ledger), encoding="utf-8")
    async with serve(policy, stderr, SERVER_ENV) as client:
        yield Gateway(client, stderr, ledger)


@pytest.fixture
def api(sandbox: SandboxProcess) -> SandboxProcess:
    """The payments API, without faults and deduplicating by key until a test says otherwise."""
    sandbox.configure()
    return sandbox


def requests_for(sandbox: SandboxProcess, key: str) -> list[dict[str, Any]]:
    return sandbox.rows("requests", idempotency_key=key)


def charge(amount: int, key: str, card: str = CARD) -> dict[str, Any]:
    return {"amount_cents": amount, "card": card, "idempotency_key": key}


def succeeded(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


# --- end to end ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_lost_response_after_commit_is_retried_with_the_same_key(
    gateway: Gateway, api: SandboxProcess
) -> None:
    api.configure(lose_response=1.0, lose_mode="drop", fault_budget=1)
    first = await call(gateway.client, "charge_forwarding", charge(1200, "lost-1"))
    body = succeeded(first)
    assert operation(first)["attempts"] == 2 and operation(first)["state"] == "SUCCEEDED"
    again = await call(gateway.client, "charge_forwarding", charge(1200, "lost-1"))
    assert succeeded(again) == body and operation(again)["replayed"] is True
    assert api.count("charges", idempotency_key="lost-1") == 1
    assert [r["fault"] for r in requests_for(api, "lost-1")] == [
        "lose_response",
        None,
    ]  # replay: no request


@pytest.mark.anyio
async def test_without_downstream_dedup_an_ambiguous_failure_is_never_rerun(
    gateway: Gateway, api: SandboxProcess
) -> None:
    api.configure(idempotency=False, lose_response=1.0, fault_budget=1)
    first = await call(gateway.client, "charge_plain", charge(700, "plain-1"))
    again = await call(gateway.client, "charge_plain", charge(700, "plain-1"))
    assert error_code(first) == error_code(again) == "operation_outcome_unknown"
    assert operation(again)["state"] == "UNKNOWN"
    assert api.count("charges", idempotency_key="plain-1") == 1
    assert len(requests_for(api, "plain-1")) == 1


@pytest.mark.anyio
async def test_a_status_declared_retryable_is_retried_and_acts_once(
    gateway: Gateway, api: SandboxProcess
) -> None:
    # The API does not dedup, and answers 500 before acting: declared so, the 500 is retried; left
    # to the default mapping, the same 500 is ambiguous and never re-run.
    api.configure(idempotency=False, fail_5xx=1.0, fault_budget=1)
    declared = await call(gateway.client, "charge_500_before_acting", charge(400, "declared-500"))
    api.configure(idempotency=False, fail_5xx=1.0, fault_budget=1)
    default = await call(gateway.client, "charge_plain", charge(400, "default-500"))
    assert operation(declared)["attempts"] == 2 and operation(declared)["state"] == "SUCCEEDED"
    assert api.count("charges", idempotency_key="declared-500") == 1
    assert [r["status"] for r in requests_for(api, "declared-500")] == [500, 200]
    assert error_code(default) == "operation_outcome_unknown"
    assert api.count("charges", idempotency_key="default-500") == 0
    assert [r["status"] for r in requests_for(api, "default-500")] == [500]


@pytest.mark.anyio
async def test_a_url_placeholder_never_leaves_its_path_segment(gateway: Gateway, api: SandboxProcess) -> None:
    """`/v1/charges/{arguments.charge}/refunds` with ".." would be POST /v1/refunds, with the key."""
    for n, dots in enumerate((".", "..")):
        key = f"dots-{n}"
        refused = await call(
            gateway.client, "refund_charge", {"charge": dots, "amount_cents": 1, "idempotency_key": key}
        )
        assert error_code(refused) == "invalid_arguments", refused.content
        assert "cannot be a segment of the URL's path" in refused.content[0].text  # type: ignore[union-attr]
        assert requests_for(api, key) == []  # nothing reached the API: not /v1/refunds, not anywhere
    paid = succeeded(await call(gateway.client, "charge_plain", charge(300, "dots-charge")))
    refund = {"charge": paid["id"], "amount_cents": 100, "idempotency_key": "dots-refund"}
    assert succeeded(await call(gateway.client, "refund_charge", refund))["charge"] == paid["id"]
    assert [r["path"] for r in requests_for(api, "dots-refund")] == [f"/v1/charges/{paid['id']}/refunds"]


@pytest.mark.anyio
async def test_429_retry_after_is_honoured(gateway: Gateway, api: SandboxProcess) -> None:
    api.configure(rate_limit=1.0, retry_after=0.5, fault_budget=1)
    result = await call(gateway.client, "charge_forwarding", charge(300, "rate-1"))
    succeeded(result)
    limited, accepted = requests_for(api, "rate-1")
    assert (limited["status"], accepted["status"]) == (429, 200)
    # The policy's own backoff is at most 10 ms: only Retry-After explains a wait of half a second.
    assert accepted["at"] - limited["at"] >= 0.5
    assert api.count("charges", idempotency_key="rate-1") == 1


@pytest.mark.anyio
async def test_a_4xx_is_recorded_as_failed_final_and_replayed(gateway: Gateway, api: SandboxProcess) -> None:
    first = await call(gateway.client, "charge_forwarding", charge(500, "declined-1", DECLINED))
    again = await call(gateway.client, "charge_forwarding", charge(500, "declined-1", DECLINED))
    status = await call(gateway.client, "get_operation_status", {"idempotency_key": "declined-1"})
    assert error_code(first) == error_code(again) == "operation_failed"
    assert "declined" in first.structured_content["error"]["message"]
    op = succeeded(status)["operation"]
    assert op["state"] == "FAILED_FINAL" and op["retry_advice"] == "do_not_retry"
    assert op["error"]["detail"]["error"]["code"] == "card_declined"  # the response body is kept
    assert api.count("charges", idempotency_key="declined-1") == 0
    assert len(requests_for(api, "declined-1")) == 1


@pytest.mark.anyio
async def test_a_timeout_is_reconciled_by_the_http_status_check(
    gateway: Gateway, api: SandboxProcess
) -> None:
    api.configure(lose_response=1.0, lose_mode="hang", hang=3.0, fault_budget=1)
    result = await call(gateway.client, "charge_checked", charge(900, "hang-1"))
    by_id = await call(gateway.client, "get_charge", {"id": succeeded(result)["id"]})
    body = succeeded(result)
    op = operation(result)
    assert op["state"] == "SUCCEEDED" and op["replayed"] is True  # the answer came from the status check
    (row,) = api.rows("charges", idempotency_key="hang-1")
    assert body["id"] == row["id"] and body["amount_cents"] == 900
    assert succeeded(by_id)["id"] == row["id"]
    assert [(r["method"], r["fault"]) for r in requests_for(api, "hang-1")] == [("POST", "lose_response")]


@pytest.mark.anyio
async def test_secrets_never_reach_the_logs_or_the_ledger(gateway: Gateway, api: SandboxProcess) -> None:
    earlier = len(gateway.stderr.read_text(encoding="utf-8"))  # the log is shared with earlier tests
    api.configure(lose_response=1.0, fault_budget=1)
    succeeded(await call(gateway.client, "charge_forwarding", charge(100, "secret-1")))
    assert error_code(await call(gateway.client, "charge_forwarding", charge(100, "secret-2", DECLINED)))
    assert api.count("charges", idempotency_key="secret-1") == 1  # the token was sent: no 401
    log = gateway.stderr.read_text(encoding="utf-8")  # each call's log line precedes its answer
    assert "charge_forwarding: POST 127.0.0.1:" in log[earlier:]  # debug logging was on and saw the calls
    assert TOKEN not in log and "Bearer" not in log
    with contextlib.closing(sqlite3.connect(gateway.ledger)) as ledger:
        dumped = "\n".join(ledger.iterdump())
    assert "secret-2" in dumped and TOKEN not in dumped


@pytest.mark.anyio
async def test_a_wrong_token_is_a_permanent_failure(gateway: Gateway, api: SandboxProcess) -> None:
    result = await call(gateway.client, "charge_wrong_token", charge(100, "wrong-token-1"))
    assert error_code(result) == "operation_failed"
    assert "HTTP 401" in result.structured_content["error"]["message"]
    assert api.count("charges", idempotency_key="wrong-token-1") == 0


# --- requests and outcomes, in process ------------------------------------------------------------


PROPERTIES = 'id = { type = "string" }, n = { type = "integer" }, tags = { type = "array", items = { type = "string" } }'


def tool(
    extra: str = "",
    http: str = 'http = { method = "POST", url = "http://127.0.0.1:9/v1/x" }',
    client: httpx2.AsyncClient | None = None,
) -> HttpTool:
    text = f"""
[tools.t]
class = "key-required"
input_schema = {{ type = "object", required = ["id"], properties = {{ {PROPERTIES} }} }}
{http}
{extra}
"""
    served = build_tools(loads_policy(text), None, Collaborators(http=client))
    source = served["t"].guard.source
    assert isinstance(source, HttpTool)
    return source


@pytest.fixture
async def shared_http() -> AsyncIterator[httpx2.AsyncClient]:
    """The pooled client a gateway would lend its http sources."""
    client = pooled_client()
    yield client
    await client.aclose()


def ctx(key: str | None = "k/1 2", session: str = "s 1") -> OperationContext:
    return OperationContext(key, session, "op_1", 1, "alice", "t")


@pytest.mark.anyio
async def test_url_placeholders_are_encoded_and_the_rest_goes_in_the_body(
    shared_http: httpx2.AsyncClient,
) -> None:
    source = tool(
        http='http = { method = "POST", url = "http://127.0.0.1:9/v1/{arguments.id}/{session}?k={idempotency_key}" }'
    )
    request = source.request.build({"id": "a/b c", "n": 3}, ctx(), shared_http)
    assert str(request.url) == "http://127.0.0.1:9/v1/a%2Fb%20c/s%201?k=k%2F1%202"
    assert request.headers["Idempotency-Key"] == "k/1 2"
    assert request.content == b'{"n":3}'


@pytest.mark.anyio
async def test_get_sends_the_rest_as_query_and_body_can_be_overridden(
    shared_http: httpx2.AsyncClient,
) -> None:
    source = tool(http='http = { method = "GET", url = "http://127.0.0.1:9/v1/x?a=1", key_header = "X-Key" }')
    request = source.request.build({"id": "7", "tags": ["p", "q"], "n": 2}, ctx(), shared_http)
    assert request.url.query == b"a=1&id=7&tags=p&tags=q&n=2"
    assert request.headers["X-Key"] == "k/1 2" and "Idempotency-Key" not in request.headers
    none = tool(http='http = { method = "POST", url = "http://127.0.0.1:9/v1/x", body = "none" }')
    assert none.request.build({"id": "7"}, ctx(), shared_http).content == b""


@pytest.mark.anyio
async def test_a_source_built_only_to_be_checked_never_sends(sandbox: SandboxProcess) -> None:
    """`policy check` builds sources without the server's client: a call is refused, not sent."""
    checked_only = tool(http=f'http = {{ method = "POST", url = "{sandbox.url}/v1/charges" }}')
    with pytest.raises(RetryableError, match="no HTTP client; the request was not sent"):
        await checked_only.call({"id": "x"}, ctx("checked-only"))
    assert sandbox.count("charges", idempotency_key="checked-only") == 0


def test_arguments_are_validated_against_the_schema_naming_the_field() -> None:
    source = tool()
    assert source.validate({"id": "x", "n": 2}) == {"id": "x", "n": 2}
    with pytest.raises(Exception, match=r"n: 'two' is not of type 'integer'"):
        source.validate({"id": "x", "n": "two"})
    with pytest.raises(Exception, match="'id' is a required property"):
        source.validate({"n": 1})
    with pytest.raises(Exception, match="unknown arguments"):
        source.validate({"id": "x", "amount": 1})


@pytest.mark.parametrize(
    ("http", "problem"),
    [
        ('http = { url = "http://h/v1/{arguments.n}" }', "must be required"),
        ('http = { url = "http://h/v1/{arguments.zz}" }', "no argument|not an argument"),
        ('http = { url = "http://h/v1/{nonsense}" }', "unknown placeholder|nonsense"),
        ('http = { url = "/v1/relative" }', "absolute|must start with http"),
    ],
)
def test_bad_http_declarations_are_reported_where_they_are(http: str, problem: str) -> None:
    with pytest.raises((PolicyError, ToolBuildError)) as caught:  # at load or when the source is built
        tool(http=http)
    assert isinstance(caught.value, PolicyError | ToolBuildError)
    problems = caught.value.problems
    assert any(p.location == "tools.t.http.url" and re.search(problem, p.message) for p in problems), problems


@pytest.mark.parametrize(
    ("http", "location", "problem"),
    [
        ('http = { url = "http://h/v1/x", outcomes = { "500" = "found" } }', "tools.t.http.outcomes.500",
         "does not apply here: use one of success, retryable, ambiguous, permanent"),
        ('http = { url = "http://h/v1/x", outcomes = { "5XX" = "retryable" } }', "tools.t.http.outcomes.5XX",
         "not an HTTP status"),
        ('http = { url = "http://h/v1/x", outcomes = { "404" = "fine" } }', "tools.t.http.outcomes.404",
         "must be 'success'"),
        ('http = { url = "http://h/v1/x" }\nstatus_check = { http = { url = "http://h/c", outcomes = { "410" = "permanent" } } }',
         "tools.t.status_check.http.outcomes.410", "use one of found, not_found, cannot_tell"),
    ],
)  # fmt: skip
def test_bad_outcome_overrides_are_reported_where_they_are(http: str, location: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        tool(http=http)
    assert any(p.location == location and problem in p.message for p in caught.value.problems), (
        caught.value.problems
    )


def test_declared_outcomes_reach_the_request() -> None:
    declared = tool(
        http='http = { url = "http://h/v1/x", outcomes = { "409" = "success", "5xx" = "retryable" } }'
    )
    assert declared.request.outcomes == {"409": "success", "5xx": "retryable"}
    assert declared.request.classify(409) == "success" and declared.request.classify(502) == "retryable"


def response(status: int, body: Any = None, **headers: str) -> httpx2.Response:
    request = httpx2.Request("POST", "http://api.test/v1/x")
    if isinstance(body, str | bytes):
        return httpx2.Response(status, content=body, headers=headers, request=request)
    return (
        httpx2.Response(status, json=body, headers=headers, request=request)
        if body is not None
        else (httpx2.Response(status, headers=headers, request=request))
    )


def plain_request(**outcomes: Outcome | Verdict) -> Request:
    return Request("POST", "http://api.test/v1/x", {}, None, "json", 5.0, outcomes)


def test_2xx_bodies_become_results() -> None:
    obj = outcome_of(response(200, {"id": "ch_1"}), plain_request())
    assert obj.structured == {"id": "ch_1"} and obj.content[0]["text"] == '{"id":"ch_1"}'
    listed = outcome_of(response(201, [1, 2]), plain_request())
    assert listed == ToolResult(content=[{"type": "text", "text": "[1,2]"}])
    assert outcome_of(response(204), plain_request()).structured is None
    assert outcome_of(response(200, "ok"), plain_request()).content[0]["text"] == "ok"


@pytest.mark.parametrize(
    ("status", "expected"),
    [(429, RetryableError), (503, RetryableError), (500, AmbiguousError), (502, AmbiguousError),
     (302, AmbiguousError), (400, PermanentError), (404, PermanentError), (409, PermanentError)],
)  # fmt: skip
def test_status_codes_map_to_outcomes(status: int, expected: type[Exception]) -> None:
    with pytest.raises(expected) as caught:
        outcome_of(response(status, {"error": {"message": "nope"}}), plain_request())
    assert f"HTTP {status}: nope" in str(caught.value)
    assert caught.value.detail == {"error": {"message": "nope"}}  # type: ignore[attr-defined]


def test_outcome_overrides_per_status_or_class() -> None:
    request = plain_request(**{"404": Outcome.SUCCESS, "5xx": Outcome.RETRYABLE})
    assert outcome_of(response(404, {"gone": True}), request).structured == {"gone": True}
    with pytest.raises(RetryableError):
        outcome_of(response(500), request)


def test_retry_after_in_seconds_or_as_an_http_date() -> None:
    now = time.time()
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(email.utils.formatdate(now + 30, usegmt=True), now) == pytest.approx(30, abs=1)
    assert retry_after_seconds(email.utils.formatdate(now - 30, usegmt=True), now) == 0.0
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None
    with pytest.raises(RetryableError) as caught:
        outcome_of(response(429, {}, **{"Retry-After": "7"}), plain_request())
    assert caught.value.retry_after == 7.0


def test_transport_failures_map_to_outcomes() -> None:
    assert isinstance(transport_outcome(httpx2.ConnectError("refused"), "x"), RetryableError)
    assert isinstance(transport_outcome(httpx2.PoolTimeout("busy"), "x"), RetryableError)
    assert isinstance(transport_outcome(httpx2.ReadTimeout("slow"), "x"), AmbiguousError)
    assert isinstance(transport_outcome(httpx2.RemoteProtocolError("dropped"), "x"), AmbiguousError)


@pytest.mark.anyio
async def test_a_refused_connection_is_retryable_and_a_404_check_means_not_found(
    sandbox: SandboxProcess, shared_http: httpx2.AsyncClient
) -> None:
    closed_port = tool(http='http = { method = "POST", url = "http://127.0.0.1:9/v1/x" }', client=shared_http)
    with pytest.raises(RetryableError, match="not sent"):
        await closed_port.call({"id": "x"}, ctx())
    checked = tool(
        extra=f'status_check = {{ http = {{ url = "{sandbox.url}/v1/charges?idempotency_key={{idempotency_key}}",'
        f' headers = {{ Authorization = "Bearer {TOKEN}" }} }} }}',
        http=f'http = {{ method = "POST", url = "{sandbox.url}/v1/charges" }}',
        client=shared_http,
    )
    assert await checked.status({"id": "x"}, ctx("never-used-key")) is None
    with pytest.raises(RuntimeError, match="cannot tell"):
        await tool(
            extra=f'status_check = {{ http = {{ url = "{sandbox.url}/v1/charges?idempotency_key=x" }} }}',
            http=f'http = {{ method = "POST", url = "{sandbox.url}/v1/charges" }}',
            client=shared_http,
        ).status({"id": "x"}, ctx())  # no token: 401, which proves nothing either way
