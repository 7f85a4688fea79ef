"""Keys from engine identity (commitgate.client.keys, .dbos, .langgraph) and errors an engine can record; no process."""

from __future__ import annotations

import pickle
import re

import pytest

from commitgate.client import CommitgateError, OperationFailed, PossibleDuplicate
from commitgate.client import langgraph as cg_langgraph
from commitgate.client.errors import error_for
from commitgate.client.keys import step_key

KEY = re.compile(r"[A-Za-z0-9._:@/+=\-]{1,255}")  # the server's key pattern (docs/contract.md)


@pytest.mark.parametrize(
    "parts",
    [("call_Jx9aQ",), ("dbos", 3, "ship"), ("é x:y=z",), ("toolu_01" + "a" * 300,), ("a" * 255,), ("",) * 2],
)
def test_any_parts_give_a_valid_key(parts: tuple[str | int, ...]) -> None:
    assert KEY.fullmatch(step_key(*parts))
    assert step_key(*parts) == step_key(*parts)


def test_different_parts_give_different_keys() -> None:
    parts = [
        ("a:b",),
        ("a", "b"),
        ("a=3Ab",),
        ("a_b",),
        ("a=5Fb",),
        ("a" * 300,),
        ("a" * 301,),
        ("dbos", 3, "x"),
    ]
    keys = [step_key(*p) for p in parts]
    assert len(set(keys)) == len(keys)
    assert step_key("call_Jx9") == "call=5FJx9" and step_key("dbos", 3, "ship") == "dbos:3:ship"


def test_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty part"):
        step_key("")


def test_dbos_identity_needs_a_running_step() -> None:
    from commitgate.client import dbos as cg_dbos  # here: DBOS takes half a second of CPU to import,
    # and every pytest worker collects this module

    with pytest.raises(RuntimeError, match=r"@DBOS.step\(\)"):
        cg_dbos.identity("ship")


def test_langgraph_identity_is_the_thread_and_the_tool_call() -> None:
    config = {"configurable": {"thread_id": "order-7"}}
    assert cg_langgraph.identity(config, "call_Jx9") == ("order-7", "call=5FJx9")
    with pytest.raises(ValueError, match="thread_id"):
        cg_langgraph.identity({}, "call_Jx9")
    with pytest.raises(ValueError, match="InjectedToolCallId"):
        cg_langgraph.identity(config, "")


@pytest.mark.parametrize(
    "code", ["possible_duplicate", "operation_failed", "budget_exceeded", "something_new"]
)
def test_errors_survive_the_pickling_an_engine_records_a_failed_step_with(code: str) -> None:
    operation = {"operation_id": "op-1", "state": "FAILED_FINAL"}
    error = error_for(
        {"code": code, "message": "card declined", "operation": operation, "duplicate_of": {"x": 1}}
    )
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and isinstance(again, CommitgateError)
    assert (again.code, again.message, again.operation, again.details) == (
        code, "card declined", operation, {"duplicate_of": {"x": 1}},
    )  # fmt: skip
    assert str(again) == str(error) == f"[{code}] card declined"
    assert isinstance(pickle.loads(pickle.dumps(OperationFailed("operation_failed", "no"))), OperationFailed)
    if isinstance(again, PossibleDuplicate):
        assert again.duplicate_of == {"x": 1}
