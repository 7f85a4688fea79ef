"""One call, three observers: its log line, its metrics sample and its `tools/call` span agree.

A real `commitgate serve` process over streamable HTTP, logging JSON lines, serving `/metrics` and
exporting OTLP to a receiver in this test. For a success, a replay, a refusal with an error code, a
tool's own failure, a call over the per-principal limit and a call the client cancels, the log line
and the span name the same code and operation id, and the `commitgate_calls_total` samples count the
same codes. The effects are counted in the system of record: one charge, no task left undone.
"""

from __future__ import annotations

import json
import secrets
from collections import Counter
from pathlib import Path
from typing import Any, cast

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.types import CallToolResult, RequestParamsMeta
from prometheus_client.parser import text_string_to_metric_families
from support.http_servers import GATED_ENV, GATED_TOOL, Served, bearer, connect, running, write_policy
from support.otlp import Span, otlp_receiver

from commitgate.server.demo import tools as demo

pytestmark = pytest.mark.anyio

META_TOOLS = {"get_operation_status", "list_operations", "compensate_session"}
CHARGE_LABELS = ("charge_card", "key-and-status-check")
GATED_LABELS = ("gated_task", "key-required")


def traced() -> tuple[str, RequestParamsMeta]:
    """A new trace id, and the `_meta` that makes the call's span a child in it."""
    trace_id = secrets.token_hex(16)
    return trace_id, cast(RequestParamsMeta, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})


def calls_total(served: Served) -> Counter[tuple[str, str, str]]:
    response = httpx2.get(served.base + "/metrics", headers=bearer("ops"))
    assert response.status_code == 200, response.text
    return Counter(
        {
            (s.labels["tool"], s.labels["idempotency_class"], s.labels["code"]): int(s.value)
            for family in text_string_to_metric_families(response.text)
            for s in family.samples
            if s.name == "commitgate_calls_total" and s.labels["tool"] not in META_TOOLS
        }
    )


def call_lines(served: Served) -> list[dict[str, Any]]:
    text = served.stderr()
    text = text[: text.rfind("\n") + 1]  # a line being written is read on the next turn
    records = [json.loads(line) for line in text.splitlines()]
    return [r for r in records if r.get("event") == "call" and r.get("tool") not in META_TOOLS]


async def wait_running(client: Client, key: str) -> None:
    with anyio.fail_after(20):
        while True:
            status = await client.call_tool("get_operation_status", {"idempotency_key": key})
            if ((status.structured_content or {}).get("operation") or {}).get("state") == "RUNNING":
                return
            await anyio.sleep(0.02)


async def test_logs_metrics_and_spans_of_a_call_agree_on_its_code_and_operation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox, gate = tmp_path / "sandbox.db", tmp_path / "gate"
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(sandbox))
    policy = write_policy(tmp_path, max_concurrent_per_principal=1, extra_tools=GATED_TOOL)
    traces: list[str] = []  # one trace per call, in the order of the calls
    with otlp_receiver() as receiver:
        env = {
            **GATED_ENV,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "commitgate-observed",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        with running(
            tmp_path, policy, "streamable-http", ledger=tmp_path / "ledger.db", sandbox=sandbox, env=env
        ) as served:
            before = calls_total(served)
            async with connect(served, "alice") as client:

                async def call(tool: str, arguments: dict[str, Any]) -> CallToolResult:
                    trace_id, meta = traced()
                    traces.append(trace_id)
                    return await client.call_tool(tool, arguments, meta=meta)

                charge = {"card": "4242", "amount_cents": 500, "idempotency_key": "k-ok"}
                first = await call("charge_card", charge)
                again = await call("charge_card", charge)
                keyless = await call("charge_card", {"card": "4242", "amount_cents": 700})
                declined = {"card": demo.DECLINED_CARD, "amount_cents": 900, "idempotency_key": "k-no"}
                failed = await call("charge_card", declined)
                over: CallToolResult | None = None
                async with anyio.create_task_group() as group:  # holds alice's one slot
                    arguments = {"gate": str(gate), "label": "held", "idempotency_key": "k-held"}
                    group.start_soon(call, "gated_task", arguments)
                    await wait_running(client, "k-held")
                    over = await call("charge_card", {**charge, "idempotency_key": "k-over"})
                    group.cancel_scope.cancel()  # the client gives up on the held call
                with anyio.fail_after(20):  # the server hears it before the tool can finish
                    while len(call_lines(served)) < 6:
                        await anyio.sleep(0.05)
                gate.touch()  # the keyed call still runs to its recorded outcome, once
                with anyio.fail_after(20):
                    while not demo.count("tasks", idempotency_key="k-held"):
                        await anyio.sleep(0.05)
            assert not first.is_error and not again.is_error
            assert keyless.is_error and failed.is_error and over is not None and over.is_error
            assert demo.count("charges") == 1  # the system of record: one charge

            expected = [
                (*CHARGE_LABELS, "ok"),
                (*CHARGE_LABELS, "ok"),
                (*CHARGE_LABELS, "idempotency_key_required"),
                (*CHARGE_LABELS, "operation_failed"),
                (*CHARGE_LABELS, "retries_exhausted"),
                (*GATED_LABELS, "cancelled"),  # it ends after the call refused over the limit
            ]
            with anyio.fail_after(20):
                while len(lines := call_lines(served)) < len(expected):
                    await anyio.sleep(0.05)
            after = calls_total(served)

        by_trace = _call_spans(receiver.wait_for(lambda spans: len(_tools_calls(spans, traces)) == 6), traces)
    assert [(line["tool"], line["class"], line["code"]) for line in lines] == expected
    assert after - before == Counter(expected)  # the metrics count the codes the log lines say

    operation_id = lines[0]["operation_id"]
    assert operation_id == first.meta["commitgate/operation"]["operation_id"]  # type: ignore[index]
    assert [line.get("operation_id") for line in lines] == [
        operation_id, operation_id, None, lines[3]["operation_id"], None, None
    ]  # fmt: skip
    assert lines[3]["operation_id"].startswith("op_") and lines[3]["state"] == "FAILED_FINAL"
    assert [line.get("replayed") for line in lines] == [False, True, None, False, None, None]

    order = [0, 1, 2, 3, 5, 4]  # calls in the order sent -> log lines in the order answered
    for sent, line in zip(order, lines, strict=True):
        span = by_trace[traces[sent]]
        assert span.attributes["commitgate.code"] == line["code"]
        assert span.attributes.get("commitgate.operation_id") == line.get("operation_id")
        assert span.attributes.get("commitgate.replayed") == line.get("replayed")
        assert span.attributes.get("commitgate.state") == line.get("state")


def _tools_calls(spans: list[Span], traces: list[str]) -> list[Span]:
    return [s for s in spans if s.trace_id in traces and s.name.startswith("tools/call ")]


def _call_spans(spans: list[Span], traces: list[str]) -> dict[str, Span]:
    found = _tools_calls(spans, traces)
    assert len(found) == len(traces), [s.name for s in found]
    return {s.trace_id: s for s in found}
