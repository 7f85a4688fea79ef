"""CEL expressions in the policy: compiled at load, four names, clear errors."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from commitgate.server.policy.expressions import CelExpression, ExpressionFailed, activation


class Holder(BaseModel):
    when: CelExpression


def test_an_expression_sees_the_call() -> None:
    when = Holder(when='arguments.amount_cents > 10000 && principal == "alice"').when
    assert when.evaluate(activation({"amount_cents": 25000}, "alice", "s", "refund")) is True
    assert when.evaluate(activation({"amount_cents": 5}, "alice", "s", "refund")) is False
    assert Holder(when="tool").when.evaluate(activation({}, "p", "s", "refund")) == "refund"


def test_it_is_written_back_as_its_source_and_compares_by_it() -> None:
    held = Holder(when="session == 'x'")
    assert held.model_dump() == {"when": "session == 'x'"}
    assert held == Holder(when="session == 'x'") != Holder(when="session == 'y'")


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("arguments.amount >", "is not valid CEL: 1:19: Syntax error"),
        ("amount > 1", "unknown name 'amount'"),
        ("user == 'a' || caller == 'b'", "unknown names 'caller', 'user'"),
        ("", "must be a CEL expression in a string"),
        (3, "must be a CEL expression in a string"),
    ],
)
def test_a_bad_expression_is_refused_at_load_with_what_is_wrong(source: object, says: str) -> None:
    with pytest.raises(ValidationError) as raised:
        Holder(when=source)
    assert says in str(raised.value)


def test_a_run_time_failure_names_the_expression_and_the_cause() -> None:
    when = Holder(when="arguments.amount_cents * 2").when
    with pytest.raises(ExpressionFailed, match=r"the call has no 'amount_cents'"):
        when.evaluate(activation({}, "p", "s", "t"))
    with pytest.raises(ExpressionFailed, match=r"arguments\.amount_cents"):
        when.evaluate(activation({"amount_cents": 2.5}, "p", "s", "t"))
