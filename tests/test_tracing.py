"""Spans of the commit boundary, in process (an in-memory exporter), and the OTEL_* switch.

The end-to-end test over OTLP/HTTP is tests/test_tracing_otlp.py; here the span tree of paths that
need a scripted tool (an ambiguous attempt reconciled in the call, a safe-retry tool), span events,
what is never put in a span, and that nothing is traced or imported when tracing is off.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.boundary import ScriptedTool, SystemOfRecord, call_request, guarded, make_boundary

from commitgate.server.core import tracing
from commitgate.server.ledger import open_ledger
from commitgate.server.model import traces
from commitgate.server.model.events import BoundaryEvent, Event
from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.serve.tracing import configure_from_env, wanted

pytestmark = pytest.mark.anyio


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """Tracing on, into memory (the global provider is left alone: other tests share this process)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traces.turn_on(provider)
    try:
        yield exporter
    finally:
        traces.turn_off()
        provider.shutdown()


def _tree(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> list[tuple[str, dict[str, Any]]]:
    children = [
        s
        for s in spans
        if s.parent is not None and parent.context is not None and s.parent.span_id == parent.context.span_id
    ]
    return [(s.name, dict(s.attributes or {})) for s in sorted(children, key=lambda s: s.start_time or 0)]


async def _guarded_call(tmp_path: Path, record: SystemOfRecord, cls: str, script: list[str]) -> Any:
    ledger = await open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        tool = guarded("charge", cls, ScriptedTool(record, script))
        boundary = make_boundary(ledger, [tool])
        boundary.observers.extend(tracing.span_events())
        tracer = traces.SWITCH.tracer
        span_cm = tracer.start_as_current_span("tools/call charge") if tracer else _no_span()
        with span_cm:
            return await boundary.call(call_request(tool, "key-secret-1", amount=424242))
    finally:
        await ledger.close()


class _no_span:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def test_an_ambiguous_attempt_reconciled_in_the_call(
    tmp_path: Path, record: SystemOfRecord, exported: InMemorySpanExporter
) -> None:
    answer = await _guarded_call(tmp_path, record, "key-and-status-check", ["ambiguous_after"])
    assert answer.error is None and record.count() == 1
    spans = exported.get_finished_spans()
    (call,) = [s for s in spans if s.name == "tools/call charge"]
    op_id = answer.operation.operation_id
    common = {"commitgate.operation_id": op_id, "commitgate.class": "key-and-status-check"}
    assert _tree(spans, call) == [
        ("commitgate.claim", {**common, "commitgate.state": "RUNNING", "commitgate.claim": "new"}),
        ("commitgate.attempt", {**common, "commitgate.attempt": 1, "commitgate.outcome": "ambiguous",
                                "error.type": "AmbiguousError"}),
        ("commitgate.reconcile", {**common, "commitgate.state": "RUNNING", "commitgate.attempt": 1,
                                  "commitgate.verdict": "found"}),
        ("commitgate.record", {**common, "commitgate.state": "SUCCEEDED", "commitgate.attempt": 1}),
    ]  # fmt: skip
    (attempt,) = [s for s in spans if s.name == "commitgate.attempt"]
    assert attempt.status.status_code.name == "ERROR"
    assert attempt.attributes is not None and attempt.attributes["error.type"] == "AmbiguousError"
    assert not attempt.events  # an exception's message may quote arguments: never recorded
    (reconcile,) = [s for s in spans if s.name == "commitgate.reconcile"]
    reconciliation = [e for e in reconcile.events if e.name == "commitgate.reconciliation"]
    assert [dict(e.attributes or {}).get("commitgate.verdict") for e in reconciliation] == ["found"]


async def test_a_safe_retry_tool_gets_one_attempt_span_per_attempt(
    tmp_path: Path, record: SystemOfRecord, exported: InMemorySpanExporter
) -> None:
    answer = await _guarded_call(tmp_path, record, "safe-retry", ["retryable", "ok"])
    assert answer.error is None
    spans = exported.get_finished_spans()
    (call,) = [s for s in spans if s.name == "tools/call charge"]
    assert [
        (name, a.get("commitgate.attempt"), a.get("commitgate.outcome")) for name, a in _tree(spans, call)
    ] == [
        ("commitgate.attempt", 1, "retryable"),
        ("commitgate.attempt", 2, "success"),
    ]


async def test_no_span_carries_arguments_results_or_keys(
    tmp_path: Path, record: SystemOfRecord, exported: InMemorySpanExporter
) -> None:
    await _guarded_call(tmp_path, record, "key-required", ["retryable", "ambiguous_after"])
    (observer,) = tracing.span_events()
    # An event has no field for arguments, messages, keys or sessions; the two that may carry what a
    # client sent (a budget's scope, an amount) stay out of spans.
    unsafe = {"arguments", "result", "message", "error", "idempotency_key", "key", "session", "principal"}
    assert not unsafe & set(BoundaryEvent._fields)
    observer(BoundaryEvent(Event.LEASE_EXPIRED, "charge", IdempotencyClass.KEY_REQUIRED, operation_id="op_1",
                           scope="session key-secret-1", amount=Decimal(424242)))  # fmt: skip
    text = repr([(s.name, s.attributes, [(e.name, e.attributes) for e in s.events], s.status.description)
                 for s in exported.get_finished_spans()])  # fmt: skip
    assert "424242" not in text and "key-secret-1" not in text and "effect_id" not in text
    assert "commitgate.lease_expired" in text  # an event with no span current gets a span of its own


async def test_off_means_no_spans_and_the_observer_unchanged(tmp_path: Path, record: SystemOfRecord) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # present, but the switch is off
    assert not traces.enabled()

    assert tracing.span_events() == []
    answer = await _guarded_call(tmp_path, record, "key-required", ["retryable", "ok"])
    assert answer.error is None and record.count() == 1
    assert exporter.get_finished_spans() == ()
    headers: dict[str, str] = {}
    traces.inject(headers)
    assert headers == {}


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, []),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, []),  # nothing asks for export
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
    ],
)
def test_only_the_standard_variables_turn_tracing_on(environ: dict[str, str], exporters: list[str]) -> None:
    assert wanted(environ) == exporters


def test_without_the_sdk_installed_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with caplog.at_level(logging.WARNING, logger="commitgate.tracing"):
        stop = configure_from_env(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    stop()
    assert not traces.enabled()
    assert "pip install 'commitgate[otel]'" in caplog.text


def test_an_unsupported_exporter_is_named_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="commitgate.tracing"):
        stop = configure_from_env(environ={"OTEL_TRACES_EXPORTER": "zipkin"})
    stop()
    assert not traces.enabled()
    assert "OTEL_TRACES_EXPORTER=zipkin is not supported" in caplog.text
