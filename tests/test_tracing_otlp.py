"""Traces end to end: a real `commitgate serve` process exporting OTLP/HTTP to a receiver in this test.

The client starts a trace (its `traceparent` in `_meta`, as an instrumented agent sends it); the
server's spans must hang under the MCP SDK's `tools/call` span in that same trace: one claim, one
attempt per attempt with its outcome, one record. An HTTP downstream must see the same trace in its
`traceparent` header, with the attempt that called it as parent. No argument value, result or key
may appear anywhere in what was exported.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import CallToolResult, RequestParamsMeta
from support.e2e import CONSOLE_SCRIPT, OPERATION_META, Deployment, policy_toml
from support.otlp import Receiver, Span, otlp_receiver

pytestmark = pytest.mark.anyio

SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
STATUS_ERROR = 2

HTTP_TOOL = """
[tools.refund]
class = "key-required"
input_schema = {{ type = "object", properties = {{ charge = {{ type = "string" }} }}, required = ["charge"] }}
http = {{ method = "POST", url = "http://127.0.0.1:{port}/refunds" }}
timeout = "10s"
"""


@dataclass
class Downstream:
    """An HTTP API that counts its effects and keeps the `traceparent` header of each request."""

    port: int = 0
    traceparents: list[str | None] = field(default_factory=list)
    refunds: int = 0


@contextlib.contextmanager
def downstream() -> Iterator[Downstream]:
    api = Downstream()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            api.traceparents.append(self.headers.get("traceparent"))
            api.refunds += 1
            body = json.dumps({"refund_id": f"re_{api.refunds}", "note": "result-value-7f3e"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()


def _params(d: Deployment, receiver: Receiver, faults: str) -> StdioServerParameters:
    env = {
        **d.env(faults),
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": "commitgate-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    args = ["serve", "--policy", str(d.policy), "--ledger", f"sqlite:///{d.ledger}"]
    return StdioServerParameters(command=str(CONSOLE_SCRIPT), args=args, env=env)


@dataclass(frozen=True)
class Trace:
    trace_id: str
    parent_id: str

    @classmethod
    def new(cls) -> Trace:
        return cls(secrets.token_hex(16), secrets.token_hex(8))

    def meta(self) -> RequestParamsMeta:
        return cast(RequestParamsMeta, {"traceparent": f"00-{self.trace_id}-{self.parent_id}-01"})


def _in(spans: list[Span], trace: Trace) -> list[Span]:
    return [s for s in spans if s.trace_id == trace.trace_id]


def _call_span(spans: list[Span], trace: Trace, tool: str) -> Span:
    (call,) = [s for s in _in(spans, trace) if s.name == f"tools/call {tool}"]
    assert call.kind == SERVER_KIND and call.parent_id == trace.parent_id
    assert call.service == "commitgate-under-test"
    return call


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id]


def _complete(traces: list[Trace]) -> Any:
    def done(spans: list[Span]) -> bool:
        return all(any(s.name.startswith("tools/call") for s in _in(spans, t)) for t in traces) and any(
            s.name == "commitgate.record" for s in spans
        )

    return done


async def test_spans_of_a_retried_call_and_of_an_http_downstream(tmp_path: Path) -> None:
    with otlp_receiver() as receiver, downstream() as api:
        d = Deployment.create(tmp_path / "d")
        d.policy.write_text(policy_toml() + HTTP_TOOL.format(port=api.port), encoding="utf-8")
        retried, replayed, refund, conflict = Trace.new(), Trace.new(), Trace.new(), Trace.new()
        secret_args = {"to": "secret-recipient@example.com", "subject": "secret-subject-91c2", "body": "b-6a"}
        key = "key-value-3d5e"
        with (tmp_path / "server.stderr").open("w") as errlog:
            transport = stdio_client(_params(d, receiver, "send_email.fail_before=2x"), errlog=errlog)
            async with Client(transport, read_timeout_seconds=30) as client:
                first = await _call(client, "send_email", {**secret_args, "idempotency_key": key}, retried)
                again = await _call(client, "send_email", {**secret_args, "idempotency_key": key}, replayed)
                other = {**secret_args, "subject": "other", "idempotency_key": key}
                reused = await _call(client, "send_email", other, conflict)
                paid = await _call(
                    client, "refund", {"charge": "ch-secret-44", "idempotency_key": "k-r"}, refund
                )
        assert not first.is_error and not again.is_error and not paid.is_error
        assert reused.is_error
        assert d.count("emails") == 1 and api.refunds == 1  # the systems of record: exactly one effect each
        spans = receiver.wait_for(_complete([retried, replayed, refund, conflict]))

        operation_id = dict((first.meta or {})[OPERATION_META])["operation_id"]
        _assert_retried_twice(spans, retried, operation_id)
        _assert_replayed(spans, replayed, operation_id)
        _assert_conflict(spans, conflict)
        _assert_downstream_joined(spans, refund, api)
        _assert_nothing_secret(receiver, [*secret_args.values(), key, "ch-secret-44", "result-value-7f3e"])


async def _call(client: Client, tool: str, arguments: dict[str, Any], trace: Trace) -> CallToolResult:
    return await client.call_tool(tool, arguments, meta=trace.meta())


def _assert_retried_twice(spans: list[Span], trace: Trace, operation_id: str) -> None:
    call = _call_span(spans, trace, "send_email")
    assert call.attributes["commitgate.operation_id"] == operation_id
    assert call.attributes["commitgate.state"] == "SUCCEEDED"
    assert call.attributes["commitgate.replayed"] is False
    assert call.attributes["commitgate.attempt"] == 3
    children = _children(spans, call)
    by_name: dict[str, list[Span]] = {}
    for child in children:
        by_name.setdefault(child.name, []).append(child)
    assert sorted(by_name) == ["commitgate.attempt", "commitgate.claim", "commitgate.record"]
    (claim,) = by_name["commitgate.claim"]
    assert claim.attributes["commitgate.operation_id"] == operation_id
    assert claim.attributes["commitgate.class"] == "key-required"
    assert claim.attributes["commitgate.claim"] == "new"
    attempts = sorted(by_name["commitgate.attempt"], key=lambda s: s.attributes["commitgate.attempt"])
    assert [a.attributes["commitgate.attempt"] for a in attempts] == [1, 2, 3]
    assert [a.attributes["commitgate.outcome"] for a in attempts] == ["retryable", "retryable", "success"]
    assert [a.status == STATUS_ERROR for a in attempts] == [True, True, False]
    assert {a.attributes["commitgate.operation_id"] for a in attempts} == {operation_id}
    (record,) = by_name["commitgate.record"]
    assert record.attributes["commitgate.state"] == "SUCCEEDED"
    assert [name for name, _ in call.events].count("commitgate.retry") == 2


def _assert_replayed(spans: list[Span], trace: Trace, operation_id: str) -> None:
    call = _call_span(spans, trace, "send_email")
    assert call.attributes["commitgate.replayed"] is True
    assert call.attributes["commitgate.operation_id"] == operation_id
    assert not any(c.name == "commitgate.attempt" for c in _children(spans, call))
    assert ("commitgate.replay", {"gen_ai.tool.name": "send_email", "commitgate.class": "key-required",
            "commitgate.operation_id": operation_id}) in call.events  # fmt: skip


def _assert_conflict(spans: list[Span], trace: Trace) -> None:
    call = _call_span(spans, trace, "send_email")
    assert "commitgate.conflict" in [name for name, _ in call.events]
    assert not any(c.name == "commitgate.attempt" for c in _children(spans, call))


def _assert_downstream_joined(spans: list[Span], trace: Trace, api: Downstream) -> None:
    call = _call_span(spans, trace, "refund")
    (attempt,) = [c for c in _children(spans, call) if c.name == "commitgate.attempt"]
    assert attempt.attributes["commitgate.outcome"] == "success"
    (header,) = api.traceparents
    assert header == f"00-{trace.trace_id}-{attempt.span_id}-01"


def _assert_nothing_secret(receiver: Receiver, values: list[str]) -> None:
    exported = b"".join(receiver.bodies)
    assert exported  # the check means something only if spans were exported
    for value in values:
        assert value.encode() not in exported, f"{value!r} was exported in a span"


UPSTREAM = """
[upstreams.inner]
command = "{command}"
args = ["serve", "--policy", "{policy}", "--ledger", "sqlite:///{ledger}"]
env = {{ OTEL_EXPORTER_OTLP_ENDPOINT = "{endpoint}", OTEL_SERVICE_NAME = "inner", OTEL_BSP_SCHEDULE_DELAY = "50", \
COMMITGATE_SANDBOX = "{sandbox}", PYTHONPATH = "{pythonpath}" }}

[tools.relay_email]
upstream = "inner"
upstream_tool = "send_email"
class = "key-required"
timeout = "20s"
"""


async def test_an_upstream_mcp_server_joins_the_trace(tmp_path: Path) -> None:
    with otlp_receiver() as receiver:
        inner = Deployment.create(tmp_path / "inner")
        outer = Deployment.create(tmp_path / "outer")
        outer.policy.write_text(
            policy_toml(respond_within="20s")
            + UPSTREAM.format(
                command=CONSOLE_SCRIPT,
                policy=inner.policy,
                ledger=inner.ledger,
                endpoint=receiver.endpoint,
                sandbox=inner.sandbox,
                pythonpath=Path(__file__).parent,
            ),
            encoding="utf-8",
        )
        trace = Trace.new()
        arguments = {"to": "ops@example.com", "subject": "s", "body": "b", "idempotency_key": "relay-1"}
        with (tmp_path / "server.stderr").open("w") as errlog:
            transport = stdio_client(_params(outer, receiver, ""), errlog=errlog)
            async with Client(transport, read_timeout_seconds=30) as client:
                answer = await _call(client, "relay_email", arguments, trace)
        assert not answer.is_error, answer.content
        assert inner.count("emails") == 1  # the effect happened once, in the upstream's system of record

        def done(spans: list[Span]) -> bool:
            return {"tools/call relay_email", "tools/call send_email"} <= {s.name for s in _in(spans, trace)}

        spans = _in(receiver.wait_for(done), trace)
        relay = _call_span(spans, trace, "relay_email")
        (attempt,) = [c for c in _children(spans, relay) if c.name == "commitgate.attempt"]
        (sent,) = [s for s in _children(spans, attempt) if s.name.startswith("MCP send tools/call")]
        (upstream_call,) = [s for s in spans if s.name == "tools/call send_email"]
        assert upstream_call.service == "inner" and upstream_call.kind == SERVER_KIND
        assert upstream_call.parent_id == sent.span_id  # one trace across both servers
        inner_children = {s.name for s in _children(spans, upstream_call)}
        assert {"commitgate.claim", "commitgate.attempt", "commitgate.record"} <= inner_children
