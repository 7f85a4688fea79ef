"""commitgate.client: keys from durable state, polling with backoff and full jitter, typed errors.

Driven against real `commitgate serve` processes over stdio; effects are counted in the sandbox.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from support.e2e import Deployment, serve

from commitgate.client import (
    Backoff,
    Gate,
    KeyReused,
    OperationFailed,
    OutcomeUnknown,
    PossibleDuplicate,
    StillRunning,
)
from commitgate.client.gate import SESSION_META, STEP_META
from commitgate.client.keys import by_arguments, prepare
from commitgate.client.text import readable
from commitgate.server.demo.tools import DECLINED_CARD
from commitgate.server.model.facts import KEY_PATTERN

CHARGE = {"card": "4242", "amount_cents": 1299, "description": "order 42"}
EMAIL = {"to": "ada@example.com", "subject": "Your order", "body": "It ships today."}


def test_the_client_imports_without_the_server_or_its_extras() -> None:
    code = (
        "import sys; sys.modules['asyncpg'] = None\n"
        "import commitgate.client\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('commitgate.server'))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_backoff_draws_each_wait_uniformly_below_a_growing_cap() -> None:
    backoff = Backoff(initial=0.1, maximum=1.0, multiplier=2.0, rng=random.Random(7))
    caps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    for attempt, cap in enumerate(caps):
        draws = [backoff.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= cap for d in draws)
        assert max(draws) > cap * 0.9 and min(draws) < cap * 0.1  # spread over the whole range


def test_a_session_must_be_given() -> None:
    with pytest.raises(ValueError, match="session must be a string"):
        Gate(object(), session="")  # type: ignore[arg-type]


def test_a_step_from_arguments_names_the_action_not_the_models_key() -> None:
    one = by_arguments("charge_card", {**CHARGE, "idempotency_key": "a"})
    assert one == by_arguments("charge_card", {"idempotency_key": "b", **dict(reversed(CHARGE.items()))})
    assert one == by_arguments("charge_card", {**CHARGE, "confirm_duplicate": True})
    assert one != by_arguments("charge_card", {**CHARGE, "amount_cents": 1300})
    assert one != by_arguments("refund", CHARGE)
    assert KEY_PATTERN.fullmatch(one)  # a key the server accepts


def test_a_step_replaces_the_models_key_and_the_run_id_is_always_sent() -> None:
    args, meta = prepare("charge_card", {**CHARGE, "idempotency_key": "k-1"}, "run-7", by_arguments)
    assert args == CHARGE and meta == {SESSION_META: "run-7", STEP_META: by_arguments("charge_card", CHARGE)}
    args, meta = prepare("charge_card", {**CHARGE, "idempotency_key": "k-1"}, "run-7", None)
    assert args["idempotency_key"] == "k-1" and meta == {SESSION_META: "run-7"}


def test_a_refusal_reads_as_commitgates_text_however_it_was_wrapped() -> None:
    error = {"code": "possible_duplicate", "message": "nothing was executed now."}
    expected = "[possible_duplicate] nothing was executed now."
    assert readable({"error": error}) == expected
    assert readable(json.dumps({"error": error})) == expected  # the structured error as JSON text
    assert readable(json.dumps({"error": json.dumps({"error": error})})) == expected  # and wrapped again
    assert readable("a tool's own words") == "a tool's own words"


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_restarted_run_replays_its_steps_instead_of_acting_again(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path)
    async with serve(d) as server:
        gate = Gate(server.client, session="run-7")
        first = await gate.call("charge_card", CHARGE, step="charge")
        assert first.replayed is False and first.operation["idempotency_key"] == "charge"
        assert first.operation["session"] == "run-7"
        again = await gate.call("charge_card", CHARGE, step="charge")
        assert again.replayed is True and again.structured == first.structured
    async with serve(d) as restarted:  # a new process, a new client, the same run id
        replay = await Gate(restarted.client, session="run-7").call("charge_card", CHARGE, step="charge")
        assert replay.replayed is True and replay.structured == first.structured
        assert d.count("charges") == 1
        other_run = await Gate(restarted.client, session="run-8").call("charge_card", CHARGE, step="charge")
        assert other_run.replayed is False
    assert d.count("charges") == 2


@pytest.mark.slow
@pytest.mark.anyio
async def test_typed_errors_carry_the_operation(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path)
    async with serve(d, faults="send_email.lose_ack=1x") as server:
        gate = Gate(server.client, session="run-1")
        first = await gate.call("charge_card", CHARGE, step="charge")
        with pytest.raises(KeyReused) as reused:
            await gate.call("charge_card", {**CHARGE, "amount_cents": 1}, step="charge")
        assert (reused.value.operation or {})["operation_id"] == first.operation["operation_id"]
        with pytest.raises(PossibleDuplicate) as duplicate:
            await gate.call("charge_card", CHARGE, step="charge-again")
        assert duplicate.value.duplicate_of["operation_id"] == first.operation["operation_id"]
        assert duplicate.value.duplicate_of["result"]["structuredContent"] == first.structured
        second = await gate.call("charge_card", CHARGE, step="charge-again", confirm_duplicate=True)
        assert second.structured is not None and first.structured is not None
        assert second.structured["charge_id"] != first.structured["charge_id"]
        with pytest.raises(OperationFailed, match="declined") as failed:
            await gate.call("charge_card", {**CHARGE, "card": DECLINED_CARD}, step="declined")
        assert (failed.value.operation or {})["state"] == "FAILED_FINAL"
        with pytest.raises(OutcomeUnknown) as unknown:
            await gate.call("send_email", EMAIL, step="email")
        assert (unknown.value.operation or {})["state"] == "UNKNOWN"
    assert d.count("charges") == 2 and d.count("emails") == 1


@pytest.mark.slow
@pytest.mark.anyio
async def test_in_progress_is_polled_with_backoff_until_done(tmp_path: Path) -> None:
    d = Deployment.create(tmp_path)
    gate_file = tmp_path / "gate"
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            gate_file.touch()  # the work finishes while the client polls
        await anyio.sleep(seconds)

    async with serve(d) as server:
        gate = Gate(server.client, session="run-2", backoff=Backoff(initial=0.2, maximum=0.4), sleep=sleep)
        done = await gate.call("gated_task", {"gate": str(gate_file), "label": "report"}, step="report")
        assert done.replayed is True and done.operation["state"] == "SUCCEEDED"
        assert done.structured is not None and done.structured["label"] == "report"
        assert len(waits) >= 3 and all(0 <= w <= 0.4 for w in waits)
        # a client that gives up first says so, and the work still lands once
        impatient = Gate(server.client, session="run-3", wait=2.0)
        with pytest.raises(StillRunning) as still:
            await impatient.call("gated_task", {"gate": str(tmp_path / "never"), "label": "x"}, step="x")
        assert still.value.operation is not None and still.value.operation["state"] == "RUNNING"
    assert d.count("tasks", idempotency_key="report") == 1
