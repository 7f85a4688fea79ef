"""The demo sandbox: effects are counted, faults behave, status checks find by key."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from commitgate.server.demo import tools as demo
from commitgate.server.model.context import OperationContext
from commitgate.server.model.outcomes import AmbiguousError, PermanentError, RetryableError


def ctx(key: str | None, session: str = "s1", principal: str = "alice") -> OperationContext:
    return OperationContext(
        idempotency_key=key, session=session, operation_id=None, attempt=1, principal=principal, tool=""
    )


@pytest.fixture(autouse=True)
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "sandbox.db"
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(path))
    monkeypatch.delenv("COMMITGATE_SANDBOX_FAULTS", raising=False)
    return path


def faults(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv("COMMITGATE_SANDBOX_FAULTS", spec)


# --------------------------------------------------------------------------- effects


def test_charge_is_counted_with_its_key(sandbox: Path) -> None:
    result = demo.charge_card("4242", 500, "tea", ctx=ctx("k1"))
    assert result["status"] == "succeeded" and result["charge_id"].startswith("ch_")
    assert demo.count("charges") == 1
    (row,) = demo.rows("charges", idempotency_key="k1")
    assert row["amount_cents"] == 500 and row["session"] == "s1" and row["principal"] == "alice"
    assert demo.store().path == sandbox


def test_the_sandbox_does_not_deduplicate() -> None:
    demo.charge_card("4242", 500, ctx=ctx("k1"))
    demo.charge_card("4242", 500, ctx=ctx("k1"))
    assert demo.count("charges", idempotency_key="k1") == 2


@pytest.mark.parametrize(("card", "amount"), [("4000000000000002", 100), ("4242", 0), ("4242", -5)])
def test_rejected_charges_leave_no_row(card: str, amount: int) -> None:
    with pytest.raises(PermanentError):
        demo.charge_card(card, amount, ctx=ctx("k1"))
    assert demo.count("charges") == 0


def test_refunds_update_the_charge_and_the_balance() -> None:
    charge = demo.charge_card("4242", 1000, ctx=ctx("c"))
    out = demo.refund(charge["charge_id"], 300, ctx=ctx("r1"))
    assert out["refund_id"].startswith("re_") and out["amount_cents"] == 300
    assert demo.rows("charges")[0]["refunded_cents"] == 300
    assert demo.get_balance("4242") == {"card": "4242", "cents": 700}
    with pytest.raises(PermanentError, match="700 cents left"):
        demo.refund(charge["charge_id"], 701, ctx=ctx("r2"))
    with pytest.raises(PermanentError, match="no such charge"):
        demo.refund("ch_nope", 1, ctx=ctx("r3"))
    assert demo.count("refunds") == 1


def test_email_is_recorded_and_written_to_the_outbox(sandbox: Path) -> None:
    out = demo.send_email("bob@example.com", "Hi", "Hello Bob", ctx=ctx("e1"))
    assert demo.count("emails", to_addr="bob@example.com") == 1
    text = (sandbox.parent / "outbox" / f"{out['message_id']}.eml").read_text()
    assert "Subject: Hi" in text and "Hello Bob" in text


def test_booking_lifecycle_and_release_twice_is_an_error() -> None:
    booking = demo.reserve("room-1", "carol", ctx=ctx("b1"))
    assert booking["status"] == "reserved"
    booking_id = booking["booking_id"]
    assert demo.confirm(booking_id, ctx=ctx("c1"))["status"] == "confirmed"
    assert demo.release(booking_id, ctx=ctx("x1"))["status"] == "released"
    with pytest.raises(PermanentError, match="already released"):
        demo.release(booking_id, ctx=ctx("x2"))
    with pytest.raises(PermanentError, match="no such booking"):
        demo.release("bk_nope", ctx=ctx("x3"))
    demo.send_cancellation_notice(booking_id, ctx=ctx("n1"))
    assert demo.count("notices", booking_id=booking_id, kind="cancellation") == 1
    assert demo.find_release(booking_id, ctx=ctx("x1")) is not None
    assert demo.find_release(booking_id, ctx=ctx("x2")) is None


def test_slow_task_is_async_and_recorded() -> None:
    out = anyio.run(demo.slow_task, 0.01, "nightly", ctx("t1"))
    assert out["task_id"].startswith("task_")
    assert demo.count("tasks", label="nightly", idempotency_key="t1") == 1


def test_reset_and_helpers_validate_names() -> None:
    demo.create_ticket("broken", ctx=ctx("t"))
    demo.reset()
    assert demo.count("tickets") == 0
    with pytest.raises(ValueError, match="unknown sandbox table"):
        demo.count("users")
    with pytest.raises(ValueError, match="unknown column"):
        demo.rows("charges", nope=1)


def test_switching_the_env_var_switches_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    demo.create_ticket("one", ctx=ctx("t"))
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(tmp_path / "other" / "sb.db"))
    assert demo.count("tickets") == 0


def test_concurrent_threads_all_land() -> None:
    threads = [threading.Thread(target=demo.create_ticket, args=(f"t{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert demo.count("tickets") == 8


# --------------------------------------------------------------------------- status checks


def test_status_checks_find_by_key_scope_and_arguments() -> None:
    made = demo.charge_card("4242", 500, "tea", ctx=ctx("k1"))
    assert demo.find_charge("4242", 500, "tea", ctx=ctx("k1")) == made
    assert demo.find_charge("4242", 500, "tea", ctx=ctx("k2")) is None
    assert demo.find_charge("4242", 500, "tea", ctx=ctx("k1", session="s2")) is None
    assert demo.find_charge("4242", 500, "tea", ctx=ctx("k1", principal="mallory")) is None
    assert demo.find_charge("4242", 501, "tea", ctx=ctx("k1")) is None

    refunded = demo.refund(made["charge_id"], 100, ctx=ctx("r1"))
    assert demo.find_refund(made["charge_id"], 100, ctx=ctx("r1")) == refunded
    sent = demo.send_email("a@b.c", "s", "b", ctx=ctx("e1"))
    assert demo.find_email("a@b.c", "s", "b", ctx=ctx("e1")) == sent
    assert demo.find_email("a@b.c", "s", "b", ctx=ctx("e2")) is None
    ticket = demo.create_ticket("t", ctx=ctx("t1"))
    assert demo.find_ticket("t", ctx=ctx("t1")) == ticket
    booking = demo.reserve("r", "c", ctx=ctx("b1"))
    assert demo.find_reservation("r", "c", ctx=ctx("b1")) == booking


def test_status_check_without_a_key_cannot_tell() -> None:
    with pytest.raises(ValueError, match="idempotency key"):
        demo.find_charge("4242", 500, ctx=None)


def test_status_check_can_be_made_unable_to_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    faults(monkeypatch, "find_charge.fail_before=1x")
    with pytest.raises(RetryableError):
        demo.find_charge("4242", 500, ctx=ctx("k1"))
    assert demo.find_charge("4242", 500, ctx=ctx("k1")) is None


# --------------------------------------------------------------------------- faults


def test_lose_ack_applies_then_raises_ambiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    faults(monkeypatch, "charge_card.lose_ack=1x")
    with pytest.raises(AmbiguousError, match="acknowledgement lost"):
        demo.charge_card("4242", 500, ctx=ctx("k1"))
    assert demo.count("charges", idempotency_key="k1") == 1
    assert demo.find_charge("4242", 500, ctx=ctx("k1")) is not None
    demo.charge_card("4242", 500, ctx=ctx("k2"))  # budget spent: acknowledged normally
    assert demo.count("charges") == 2


def test_fail_before_leaves_no_row(monkeypatch: pytest.MonkeyPatch) -> None:
    faults(monkeypatch, "send_email.fail_before=2x")
    for _ in range(2):
        with pytest.raises(RetryableError):
            demo.send_email("a@b.c", "s", "b", ctx=ctx("e1"))
    assert demo.count("emails") == 0
    demo.send_email("a@b.c", "s", "b", ctx=ctx("e1"))
    assert demo.count("emails") == 1


def test_fail_permanent_and_probabilities(monkeypatch: pytest.MonkeyPatch) -> None:
    faults(monkeypatch, "confirm.fail_permanent=100%,create_ticket.lose_ack=0%")
    booking = demo.reserve("r", "c", ctx=ctx("b1"))
    with pytest.raises(PermanentError, match="injected"):
        demo.confirm(booking["booking_id"], ctx=ctx("c1"))
    assert demo.rows("bookings")[0]["status"] == "reserved"
    demo.create_ticket("never loses", ctx=ctx("t1"))


def test_rejected_effect_does_not_spend_a_post_effect_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    faults(monkeypatch, "charge_card.lose_ack=1x")
    with pytest.raises(PermanentError):
        demo.charge_card("4000000000000002", 100, ctx=ctx("k1"))
    with pytest.raises(AmbiguousError):
        demo.charge_card("4242", 100, ctx=ctx("k2"))


def test_integer_budgets_are_shared_across_store_instances(sandbox: Path) -> None:
    first, second = demo.SandboxStore(sandbox), demo.SandboxStore(sandbox)
    taken = []
    for s in (first, second, first, second):
        with s.transaction() as conn:
            taken.append(s.take_budget(conn, "refund", "fail_before", 3))
    assert taken == [True, True, True, False]
    assert second.rows("faults", tool="refund") == [
        {"tool": "refund", "kind": "fail_before", "budget": 3, "remaining": 0}
    ]


def test_latency_and_timeout_after_effect_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    faults(monkeypatch, "create_ticket.latency=0.05s,create_ticket.timeout_after_effect=0.05s")
    start = time.monotonic()
    demo.create_ticket("slow", ctx=ctx("t1"))
    assert time.monotonic() - start >= 0.1
    assert demo.count("tickets") == 1


_CRASH_CHILD = """
from commitgate.server.demo import tools as demo
from commitgate.server.model.context import OperationContext
demo.refund("{charge_id}", 100, OperationContext("r1", "s1", None, 1, "alice"))
print("survived")
"""


def test_crash_after_effect_exits_137_with_the_row_committed_and_only_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    charge = demo.charge_card("4242", 1000, ctx=ctx("c"))
    env = {**os.environ, "COMMITGATE_SANDBOX_FAULTS": "refund.crash_after_effect=1x"}
    code = _CRASH_CHILD.format(charge_id=charge["charge_id"])

    def child() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
        )

    crashed = child()
    assert crashed.returncode == 137, crashed.stderr
    assert "survived" not in crashed.stdout
    assert demo.count("refunds", idempotency_key="r1") == 1
    assert demo.rows("charges")[0]["refunded_cents"] == 100

    restarted = child()  # a "restarted process" with the same spec: the budget is already spent
    assert restarted.returncode == 0, restarted.stderr
    assert demo.count("refunds", idempotency_key="r1") == 2


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("charge_card", "expected tool.kind=value"),
        ("charge_card.lose_ack", "expected tool.kind=value"),
        ("charge_crad.lose_ack=1x", "unknown tool"),
        ("charge_card.explode=1", "unknown kind"),
        ("charge_card.lose_ack=150%", "bad value"),
        ("charge_card.lose_ack=-1", "bad value"),
        ("charge_card.latency=soon", "bad value"),
        ("find_charge.lose_ack=1x", "needs a tool with a side effect"),
        ("refund.fail_before=1x,refund.fail_before=2x", "given twice"),
        ("charge_card.lose_ack=1", "a count like '1x'"),  # a count or a chance? say which
        ("charge_card.lose_ack=0.5", "a chance like '50%'"),
        ("charge_card.latency=2", "a time with its unit"),
    ],
)
def test_malformed_specs_name_the_bad_entry(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as err:
        demo.parse_faults(spec)
    assert spec.split(",")[-1] in str(err.value)


def test_spec_grammar_example_parses() -> None:
    parsed = demo.parse_faults(
        "charge_card.lose_ack=50%, refund.crash_after_effect=1x,charge_card.latency=0.2s,"
        "send_email.fail_before=2x,confirm.fail_permanent=30%,"
    )
    assert parsed["charge_card"]["lose_ack"].probability == 0.5
    assert parsed["charge_card"]["latency"].seconds == 0.2
    assert parsed["refund"]["crash_after_effect"].budget == 1
    assert parsed["send_email"]["fail_before"].budget == 2


_WORKER = """
from commitgate.server.demo import tools as demo
from commitgate.server.model.outcomes import RetryableError
failed = 0
for i in range(10):
    try:
        demo.create_ticket(f"t{i}")
    except RetryableError:
        failed += 1
print(failed)
"""


def test_processes_share_the_store_and_the_fault_budget(sandbox: Path) -> None:
    # The children also race to create the fresh database file.
    env = {**os.environ, "COMMITGATE_SANDBOX_FAULTS": "create_ticket.fail_before=5x"}
    children = [
        subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    failures = [int(p.communicate(timeout=30)[0]) for p in children]
    assert all(p.returncode == 0 for p in children)
    assert sum(failures) == 5
    assert demo.count("tickets") == 40 - 5
