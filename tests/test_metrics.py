"""Observability in process: Prometheus metrics from boundary events and the ledger, and JSON-lines logs."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from commitgate.server.demo import tools as demo
from commitgate.server.model.events import BoundaryEvent, CallAnswered, Event
from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.outcomes import Outcome, Verdict
from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve import logs
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.logs import configure_logging, log_call, log_event
from commitgate.server.serve.metrics import Metrics

POLICY = """
[server]
lease = "3s"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
retry = { attempts = 3, initial = "10ms", max = "20ms" }

[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"
retry = { attempts = 3, initial = "10ms", max = "20ms" }
"""
KEYED = IdempotencyClass.KEY_REQUIRED


@pytest.fixture(autouse=True)
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "sandbox.db"
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(path))
    monkeypatch.delenv("COMMITGATE_SANDBOX_FAULTS", raising=False)
    return path


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    policy = loads_policy(POLICY)
    policy.ledger.url = f"sqlite:///{tmp_path / 'ledger.db'}"
    policy.ledger.synchronous = "NORMAL"
    gw = await Gateway.open(policy, None)
    try:
        yield gw
    finally:
        await gw.close()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(scraped: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return scraped.get((name, frozenset(labels.items())), 0.0)


async def scrape(metrics: Metrics, gateway: Gateway) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return samples((await metrics.exposition(gateway.ledger)).decode())


def charge(key: str, amount: int = 500) -> dict[str, Any]:
    return {"card": "4242", "amount_cents": amount, "idempotency_key": key}


CS = {"tool": "charge_card", "idempotency_class": "key-and-status-check"}


@pytest.mark.anyio
async def test_replays_conflicts_completions_and_ledger_steps_are_counted(gateway: Gateway) -> None:
    metrics = Metrics()
    metrics.attach(gateway)
    first = await gateway.call_tool("charge_card", charge("k1"), {}, "alice")
    again = await gateway.call_tool("charge_card", charge("k1"), {}, "alice")
    clash = await gateway.call_tool("charge_card", charge("k1", 900), {}, "alice")
    assert not first.is_error and not again.is_error and clash.is_error
    assert demo.count("charges") == 1

    scraped = await scrape(metrics, gateway)
    assert value(scraped, "commitgate_replays_total", **CS) == 1
    assert value(scraped, "commitgate_conflicts_total", **CS) == 1
    assert value(scraped, "commitgate_attempts_total", outcome="success", **CS) == 1
    assert value(scraped, "commitgate_completions_total", state="SUCCEEDED", **CS) == 1
    assert value(scraped, "commitgate_operations", state="SUCCEEDED") == 1
    assert value(scraped, "commitgate_operations", state="UNKNOWN") == 0
    assert value(scraped, "commitgate_ledger_up") == 1
    # new and conflict; the replay of a final outcome is answered from memory (server/replays.py)
    assert value(scraped, "commitgate_ledger_seconds_count", method="claim") == 2


@pytest.mark.anyio
async def test_retries_and_reconciliations_are_counted(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = Metrics()
    metrics.attach(gateway)
    monkeypatch.setenv("COMMITGATE_SANDBOX_FAULTS", "charge_card.fail_before=1x,create_ticket.lose_ack=1x")
    retried = await gateway.call_tool("charge_card", charge("k2"), {}, "alice")
    assert not retried.is_error
    lost = await gateway.call_tool("create_ticket", {"title": "t", "idempotency_key": "k3"}, {}, "alice")
    assert lost.is_error  # key-required: an ambiguous failure is UNKNOWN, never re-run
    assert demo.count("charges") == 1 and demo.count("tickets") == 1

    scraped = await scrape(metrics, gateway)
    assert value(scraped, "commitgate_retries_total", **CS) == 1
    assert value(scraped, "commitgate_attempts_total", outcome="retryable", **CS) == 1
    ct = {"tool": "create_ticket", "idempotency_class": "key-required"}
    assert value(scraped, "commitgate_attempts_total", outcome="ambiguous", **ct) == 1
    assert value(scraped, "commitgate_completions_total", state="UNKNOWN", **ct) == 1
    assert value(scraped, "commitgate_operations", state="UNKNOWN") == 1

    monkeypatch.setenv("COMMITGATE_SANDBOX_FAULTS", "charge_card.lose_ack=1x")
    found = await gateway.call_tool("charge_card", charge("k4", 700), {}, "alice")
    assert not found.is_error  # the status check found the charge that lost its acknowledgement
    scraped = await scrape(metrics, gateway)
    assert value(scraped, "commitgate_reconciliations_total", verdict="found", **CS) == 1
    assert demo.count("charges") == 2


def test_the_observer_ignores_what_it_does_not_know_and_never_raises() -> None:
    metrics = Metrics()
    metrics(BoundaryEvent("no_such_event", "t", KEYED, operation_id=object()))  # type: ignore[arg-type]
    metrics(BoundaryEvent(Event.COMPLETED, "t", KEYED, state=State.SUCCEEDED, seconds="not a number"))  # type: ignore[arg-type]
    metrics(BoundaryEvent(Event.LEASE_EXPIRED, "t", KEYED))
    metrics(BoundaryEvent(Event.COMPLETED, "t", KEYED, state=State.SUCCEEDED, seconds=1.5))
    scraped = samples(generate_latest(metrics.registry).decode())
    labels = {"tool": "t", "idempotency_class": "key-required"}
    assert value(scraped, "commitgate_lease_expiries_total", **labels) == 1
    assert value(scraped, "commitgate_completions_total", state="SUCCEEDED", **labels) == 2
    assert value(scraped, "commitgate_operation_seconds_count", state="SUCCEEDED", **labels) == 1


def test_every_boundary_event_has_a_metric() -> None:
    """A new event without a counter would be invisible to operators; this fails until it has one."""
    metrics = Metrics()
    for event in Event:
        metrics(
            BoundaryEvent(
                event, "t", KEYED, outcome=Outcome.SUCCESS, verdict=Verdict.FOUND, state=State.UNKNOWN
            )
        )
    scraped = samples(generate_latest(metrics.registry).decode())
    counted = {name for name, _ in scraped if name.endswith("_total")}
    assert len(counted) >= len(Event), sorted(counted)
    assert (
        value(scraped, "commitgate_results_too_large_total", tool="t", idempotency_class="key-required") == 1
    )


@pytest.mark.anyio
async def test_attach_chains_the_existing_observer_once(tmp_path: Path) -> None:
    seen: list[str] = []
    policy = loads_policy(POLICY)
    policy.ledger.url = f"sqlite:///{tmp_path / 'chained.db'}"
    gw = await Gateway.open(policy, None, observers=[lambda event: seen.append(event.kind)])
    try:
        metrics = Metrics()
        metrics.attach(gw)
        metrics.attach(gw)
        assert gw.ledger.timer == metrics.ledger_step
        assert gw.boundary.ledger is gw.ledger
        await gw.call_tool("charge_card", charge("k5"), {}, "alice")
        await gw.call_tool("charge_card", charge("k5"), {}, "alice")
        assert seen.count("replay") == 1
        scraped = await scrape(metrics, gw)
        assert value(scraped, "commitgate_replays_total", **CS) == 1
    finally:
        await gw.close()


@pytest.mark.anyio
async def test_a_scrape_still_answers_when_the_ledger_cannot_be_read(tmp_path: Path) -> None:
    policy = loads_policy(POLICY)
    policy.ledger.url = f"sqlite:///{tmp_path / 'closed.db'}"
    gw = await Gateway.open(policy, None)
    await gw.close()
    metrics = Metrics()
    scraped = await scrape(metrics, gw)
    assert value(scraped, "commitgate_ledger_up") == 0


def test_calls_are_counted_by_code() -> None:
    metrics = Metrics()
    for code, seconds in (("ok", 0.01), ("invalid_arguments", 0.001), ("ok", 0.02)):
        metrics.answered(CallAnswered("charge_card", "key-and-status-check", "alice", code, seconds))
    scraped = samples(generate_latest(metrics.registry).decode())
    assert value(scraped, "commitgate_calls_total", code="ok", **CS) == 2
    assert value(scraped, "commitgate_calls_total", code="invalid_arguments", **CS) == 1
    assert value(scraped, "commitgate_call_seconds_count", **CS) == 3


# --- logs -------------------------------------------------------------------------------------------

SECRET = "SECRET-VALUE-7f3a"
REFUSED = CallAnswered(
    "charge_card", "key-and-status-check", "alice", "invalid_arguments", 0.5,
    message=f"bad {SECRET}", arguments={"description": SECRET},
)  # fmt: skip


@pytest.fixture
def logged() -> Iterator[io.StringIO]:
    """Configure JSON logging into a buffer; restore the root logger afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        yield stream
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        logs._state["unredacted"] = False
        logging.captureWarnings(False)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.anyio
async def test_boundary_events_are_json_lines_without_argument_values(
    gateway: Gateway, logged: io.StringIO
) -> None:
    configure_logging("debug", stream=logged)
    gateway.boundary.observers = [log_event]
    args = {"card": "4242", "amount_cents": 500, "description": SECRET, "idempotency_key": "k6"}
    await gateway.call_tool("charge_card", args, {}, "alice")
    await gateway.call_tool("charge_card", args, {}, "alice")
    log_call(REFUSED)
    records = lines(logged)
    events = [r for r in records if r["logger"] == "commitgate.events"]
    assert [e["event"] for e in events] == ["attempt", "completed", "replay"]
    completed = events[1]
    assert completed["operation_id"].startswith("op_") and completed["seconds"] >= 0
    assert completed | {"ts": None, "operation_id": None, "seconds": None} == {
        "ts": None, "level": "info", "logger": "commitgate.events", "msg": "completed",
        "event": "completed", "tool": "charge_card", "class": "key-and-status-check", "state": "SUCCEEDED",
        "operation_id": None, "seconds": None,
    }  # fmt: skip
    (call,) = [r for r in records if r["logger"] == "commitgate.calls"]
    assert call["code"] == "invalid_arguments" and "message" not in call and "arguments" not in call
    assert SECRET not in logged.getvalue()


def test_other_libraries_are_redacted_unless_asked(logged: io.StringIO) -> None:
    configure_logging("debug", stream=logged)
    sdk = logging.getLogger("mcp.server.sse")
    sdk.debug(f"Received JSON: {SECRET}")
    sdk.warning("could not parse %s", SECRET)
    try:
        raise ValueError(f"input_value={SECRET}")
    except ValueError:
        sdk.exception("Failed to parse message")
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "POST", f"/messages/?session_id={SECRET}", "1.1", 202
    )
    records = lines(logged)
    assert SECRET not in logged.getvalue()
    assert [r["msg"] for r in records] == ["could not parse %s", "Failed to parse message", "request"]
    assert records[0]["redacted"] is True
    assert records[1]["exc_type"] == "ValueError" and records[1]["frames"]
    assert records[2]["path"] == "/messages/" and records[2]["status"] == 202


def test_debug_unredacted_shows_everything(logged: io.StringIO) -> None:
    configure_logging("debug", unredacted=True, stream=logged)
    logging.getLogger("mcp.server.sse").debug(f"Received JSON: {SECRET}")
    log_call(REFUSED)
    records = lines(logged)
    assert records[0]["msg"] == f"Received JSON: {SECRET}"
    assert records[1]["message"] == f"bad {SECRET}" and records[1]["arguments"] == {"description": SECRET}
