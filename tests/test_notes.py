"""The typed records the ledger keeps beside an operation are stored exactly as the dicts they replace.

Each text below is what the ledger has always written for that kind of record. Read and written
again it is the same text, and the code that makes each record writes it the same way, so
existing ledgers read and write as they always did.
"""

from __future__ import annotations

import json
from decimal import Decimal
from types import SimpleNamespace
from typing import Any, cast

import pytest

from commitgate.server.core import approvals, reconcile, resolutions
from commitgate.server.core.retry import error_record
from commitgate.server.ledger.base import LEASE_LOST, BudgetCheck, over_budget_wait
from commitgate.server.ledger.sqlite._schema import dump, dump_record
from commitgate.server.model.facts import ApprovalState
from commitgate.server.model.notes import ApprovalRecord, BudgetFigures, ErrorRecord, ReconciliationNote
from commitgate.server.model.outcomes import Outcome, PermanentError, RetryableError
from commitgate.server.model.records import Operation
from commitgate.server.policy.approvals import ApprovalPolicy

T0 = 1_000.0
AWAITING = '{"state":"awaiting","deciders":["client","operator"],"requested_at":1000.0,"expires_at":1060.0}'
STORED: list[tuple[type[Any], str]] = [
    (ApprovalRecord, AWAITING),
    (
        ApprovalRecord,
        '{"state":"awaiting","deciders":["operator"],"requested_at":1000.0,"expires_at":1060.0,'
        '"duplicate_of":"op_1","required_because":"approval.when failed: x",'
        '"over_budget":{"name":"payments","limit":1000,"spent":800,"amount":400,"unit":"USD cents"}}',
    ),
    (
        ApprovalRecord,
        '{"state":"approved","deciders":["client","operator"],"requested_at":1000.0,"expires_at":1060.0,'
        '"by":"anna","via":"operator","reason":null,"decided_at":1005.0}',
    ),
    (
        ApprovalRecord,
        '{"state":"expired","deciders":["operator"],"requested_at":1000.0,"expires_at":1060.0,'
        '"by":null,"via":"timeout","reason":null,"decided_at":1061.0}',
    ),
    (ErrorRecord, '{"outcome":"permanent","type":"PermanentError","message":"card declined"}'),
    (ErrorRecord, '{"outcome":"retryable","type":"RetryableError","message":"busy","detail":{"retry_in":3}}'),
    (ErrorRecord, '{"code":"lease_expired","message":"the process running this operation stopped"}'),
    (
        ErrorRecord,
        '{"code":"budget_exceeded","message":"Budget exceeded",'
        '"budget":{"name":"payments","limit":1000,"spent":1000,"window":"1h"}}',
    ),
    (ErrorRecord, '{"outcome":"retryable","message":"the status check found no trace of it"}'),
    (ErrorRecord, '{"code":"x","message":"kept","written_by":"a later version"}'),
    (ReconciliationNote, '{"by":"status_check","at":1000.0,"verdict":"cannot_tell","error":"timeout"}'),
    (ReconciliationNote, '{"by":"status_check","at":1000.0,"verdict":"found","asked_by":"anna"}'),
    (
        ReconciliationNote,
        '{"by":"operator","operator":"anna","reason":"in the outbox","at":1000.0,"verdict":"succeeded"}',
    ),
    (ReconciliationNote, '{"by":"owner","at":1000.0,"verdict":"failed_final"}'),
]


@pytest.mark.parametrize(("kind", "text"), STORED)
def test_a_stored_record_reads_and_writes_back_as_the_same_text(kind: Any, text: str) -> None:
    assert dump_record(kind.from_stored(json.loads(text))) == text


def test_records_the_code_makes_are_stored_as_before() -> None:
    policy = ApprovalPolicy(via=["client", "operator"], timeout=60)
    asked = approvals.record(policy, T0)
    assert dump_record(asked) == AWAITING
    decided = asked.decided(ApprovalState.APPROVED, "anna", "operator", None, T0 + 5)
    assert dump_record(decided) == json.dumps(
        {**json.loads(AWAITING), "state": "approved", "by": "anna", "via": "operator", "reason": None,
         "decided_at": T0 + 5},
        separators=(",", ":"),
    )  # fmt: skip
    budget_wait = approvals.record(ApprovalPolicy(via=["operator"]), T0)
    check = BudgetCheck("payments", "all", Decimal(400), Decimal(1000), 3600.0, approval=budget_wait)
    waiting = over_budget_wait(check, asked, Decimal(800))
    assert json.loads(dump_record(waiting) or "") == {
        **json.loads(AWAITING), "deciders": ["operator"],
        "over_budget": {"name": "payments", "limit": 1000, "spent": 800, "amount": 400},
    }  # fmt: skip
    assert list(json.loads(dump_record(waiting) or "")) == [*json.loads(AWAITING), "over_budget"]
    assert dump_record(error_record(PermanentError("card declined"), Outcome.PERMANENT)) == STORED[4][1]
    assert dump_record(error_record(RetryableError("busy"), Outcome.RETRYABLE)) == (
        '{"outcome":"retryable","type":"RetryableError","message":"busy"}'
    )
    assert dump_record(LEASE_LOST) == (
        '{"code":"lease_expired","message":"the process running this operation stopped before recording its outcome"}'
    )
    note = ReconciliationNote("status_check", T0, "not_found")
    not_found = reconcile.not_found(cast(Operation, SimpleNamespace(fence=1)), note)
    assert dump_record(not_found.error) == STORED[8][1]
    assert dump_record(not_found.reconciliation) == '{"by":"status_check","at":1000.0,"verdict":"not_found"}'
    change = resolutions.transition(
        resolutions.Resolution(resolutions.Finding.SUCCEEDED, "anna", "in the outbox"), T0
    )
    assert dump_record(change.reconciliation) == STORED[12][1]
    failed = resolutions.transition(
        resolutions.Resolution(resolutions.Finding.FAILED, "anna", "not there"), T0
    )
    assert dump_record(failed.error) == (
        '{"outcome":"permanent","type":"OperatorResolution","message":"not there (resolved by anna)"}'
    )
    assert dump_record(failed.reconciliation) == (
        '{"by":"operator","operator":"anna","reason":"not there","at":1000.0,"verdict":"failed"}'
    )


def test_unknown_keys_are_kept_and_compared() -> None:
    later = ErrorRecord.from_stored({"code": "x", "message": "kept", "written_by": "a later version"})
    assert later.extra == {"written_by": "a later version"}
    assert later != ErrorRecord(code="x", message="kept")


OVER = '{"name":"payments","limit":1000,"spent":700.5,"amount":0.1,"unit":"USD cents","by_a_later_version":1}'
OLD_WAITING = (  # an approval record as an older version wrote it: the figures a bare dict then
    '{"state":"awaiting","deciders":["operator"],"requested_at":1000.0,"expires_at":1060.0,'
    '"over_budget":{"name":"payments","limit":1000,"spent":800,"amount":400}}'
)


def test_over_budget_figures_read_into_their_type_and_write_back_as_the_same_text() -> None:
    figures = BudgetFigures.from_stored(json.loads(OVER))
    assert (figures.name, figures.limit, figures.spent, figures.amount, figures.unit) == (
        "payments", Decimal(1000), Decimal("700.5"), Decimal("0.1"), "USD cents",
    )  # fmt: skip
    assert dump(figures.stored()) == OVER
    assert figures.shown() == {k: v for k, v in json.loads(OVER).items() if k != "by_a_later_version"}
    old = ApprovalRecord.from_stored(json.loads(OLD_WAITING))
    assert old.over_budget == BudgetFigures("payments", Decimal(1000), Decimal(800), Decimal(400))
    assert dump_record(old) == OLD_WAITING and old.over_budget is not None
    assert approvals.over_budget_text(old.over_budget) == (
        "Over budget 'payments': this call spends 400, 800 of 1000 is already spent in its window, "
        "so 200 is left; approving spends past the limit."
    )
