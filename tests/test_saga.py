"""Sagas end to end (seed experiment 4): reserve -> pay -> confirm through a real server over stdio.

Confirmation fails 30 % of the time; a failed order is compensated with
compensate_session. Effects are counted in the sandbox store.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from support.e2e import as_meta

from commitgate.server.core.saga import TemplateError, render_arguments
from commitgate.server.demo import tools as demo

pytestmark = pytest.mark.anyio


def server(tmp: Path, faults: str = "") -> StdioServerParameters:
    env = {
        "COMMITGATE_SANDBOX": str(tmp / "sandbox.db"),
        "COMMITGATE_SANDBOX_FAULTS": faults,
        "PYTHONUNBUFFERED": "1",
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp),
    }
    args = ["-m", "commitgate.server.cli", "serve", "--ledger", f"sqlite:///{tmp / 'ledger.db'}"]
    return StdioServerParameters(command=sys.executable, args=args, env=env)


@contextlib.asynccontextmanager
async def client(tmp: Path, faults: str = "") -> AsyncIterator[Client]:
    async with Client(server(tmp, faults), read_timeout_seconds=30) as session:
        yield session


async def call(session: Client, tool: str, order: str, **arguments: Any) -> Any:
    return await session.call_tool(tool, arguments, meta=as_meta({"commitgate/session": order}))


def code(result: Any) -> str | None:
    return (result.structured_content or {}).get("error", {}).get("code") if result.is_error else None


async def book(session: Client, n: int) -> tuple[str, str, bool]:
    order = f"order-{n}"
    booking = await call(
        session, "reserve", order, resource=f"room-{n}", customer=f"c-{n}", idempotency_key="reserve"
    )
    booking_id = booking.structured_content["booking_id"]
    paid = await call(
        session, "pay_booking", order, card=f"card-{n}", amount_cents=1000 + n, idempotency_key="pay"
    )
    assert not paid.is_error
    confirmed = await call(session, "confirm", order, booking_id=booking_id, idempotency_key="confirm")
    if confirmed.is_error:
        assert code(confirmed) == "operation_failed"
    return order, booking_id, not confirmed.is_error


async def test_experiment_4_no_customer_charged_without_confirmation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(tmp_path / "sandbox.db"))
    orders = 100
    async with client(tmp_path, faults="confirm.fail_permanent=30%") as session:
        booked = [await book(session, n) for n in range(orders)]
        failed = [(order, booking) for order, booking, ok in booked if not ok]
        assert 10 <= len(failed) <= 50  # 30 % of 100, loosely: the fault is random
        for order, _ in failed:
            answer = await session.call_tool(
                "compensate_session",
                {"reason": "confirmation failed"},
                meta=as_meta({"commitgate/session": order}),
            )
            saga = answer.structured_content
            assert saga["state"] == "COMPLETED", saga
            assert [c["tool"] for c in saga["compensations"]] == ["pay_booking", "reserve"]  # newest first
            assert all(c["state"] == "COMPENSATED" for c in saga["compensations"])

        # Post-conditions in the system of record.
        for n, (_order, booking_id, ok) in enumerate(booked):
            charge = demo.rows("charges", card=f"card-{n}")
            assert len(charge) == 1
            refunds = demo.count("refunds", charge_id=charge[0]["id"])
            status = demo.rows("bookings", id=booking_id)[0]["status"]
            if ok:
                assert (status, refunds, charge[0]["refunded_cents"]) == ("confirmed", 0, 0)
            else:  # charged without confirmation: never, after compensation
                assert (status, refunds, charge[0]["refunded_cents"]) == ("released", 1, 1000 + n)
        assert demo.count("refunds") == len(failed)
        assert demo.count("notices") == 0  # confirm never succeeded where compensated

        # Re-running compensation changes nothing.
        for order, _ in failed:
            again = await session.call_tool(
                "compensate_session", {}, meta=as_meta({"commitgate/session": order})
            )
            assert again.structured_content["state"] == "COMPLETED"
            assert all(c.get("compensated_earlier") for c in again.structured_content["compensations"])
        assert demo.count("refunds") == len(failed)
        assert demo.count("bookings", status="released") == len(failed)

        # A session with nothing compensable.
        nothing = await session.call_tool(
            "compensate_session", {}, meta=as_meta({"commitgate/session": "empty"})
        )
        assert nothing.structured_content["state"] == "NOTHING_TO_DO"


async def test_crash_in_the_middle_of_compensation_is_finished_without_doubling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(tmp_path / "sandbox.db"))
    async with client(tmp_path) as session:
        booking = await call(
            session, "reserve", "trip", resource="room-9", customer="ana", idempotency_key="r"
        )
        await call(session, "pay_booking", "trip", card="card-9", amount_cents=4200, idempotency_key="p")
    booking_id = booking.structured_content["booking_id"]

    # The release applies, then the server dies before recording it (kill -9 equivalent: os._exit).
    with contextlib.suppress(Exception):
        async with client(tmp_path, faults="release.crash_after_effect=1x") as session:
            await session.call_tool("compensate_session", {}, meta=as_meta({"commitgate/session": "trip"}))
    assert demo.count("refunds") == 1
    assert demo.rows("bookings", id=booking_id)[0]["status"] == "released"

    async with client(tmp_path) as session:
        answer = await session.call_tool(
            "compensate_session", {}, meta=as_meta({"commitgate/session": "trip"})
        )
        saga = answer.structured_content
        assert saga["state"] == "COMPLETED", saga
        assert [c["tool"] for c in saga["compensations"]] == ["pay_booking", "reserve"]
        listed = await session.call_tool("list_operations", {"session": "trip"})
    assert demo.count("refunds") == 1  # never undone twice
    assert demo.count("bookings", status="released") == 1
    states = {op["idempotency_key"]: op["state"] for op in listed.structured_content["operations"]}
    assert states["r"] == states["p"] == "COMPENSATED"


async def test_compensation_that_cannot_run_reports_partial_and_a_later_call_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(tmp_path / "sandbox.db"))
    async with client(tmp_path, faults="refund.fail_before=9x") as session:
        await call(session, "reserve", "s", resource="room-1", customer="bo", idempotency_key="r")
        await call(session, "pay_booking", "s", card="card-1", amount_cents=100, idempotency_key="p")
        first = (
            await session.call_tool("compensate_session", {}, meta=as_meta({"commitgate/session": "s"}))
        ).structured_content
    assert first["state"] == "PARTIAL"
    by_tool = {c["tool"]: c for c in first["compensations"]}
    assert (
        by_tool["pay_booking"]["state"] == "FAILED_RETRYABLE"
        and "retries_exhausted" in by_tool["pay_booking"]["reason"]
    )
    assert by_tool["reserve"]["state"] == "COMPENSATED"  # one failure does not stop the others
    assert demo.count("refunds") == 0
    async with client(tmp_path) as session:
        second = (
            await session.call_tool("compensate_session", {}, meta=as_meta({"commitgate/session": "s"}))
        ).structured_content
    assert second["state"] == "COMPLETED"
    assert demo.count("refunds") == 1 and demo.count("bookings", status="released") == 1


def test_templates_fill_nested_paths_and_keep_types() -> None:
    rendered = render_arguments(
        {"id": "{result.booking.id}", "cents": "{arguments.amount}", "note": "order {arguments.order}"},
        {"amount": 250, "order": "A-1"},
        {"booking": {"id": "bk_1"}},
    )
    assert rendered == {"id": "bk_1", "cents": 250, "note": "order A-1"}
    with pytest.raises(TemplateError):
        render_arguments("{result.missing}", {}, {})
