"""CEL expressions in the policy: compiled at load, four names, clear errors."""

from __future__ import annotations

import subprocess
import sys

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


def test_the_server_starts_without_the_cel_packages_interactive_shell() -> None:
    """`import cel` also imports its shell (prompt_toolkit and more), about 230 ms of every start of
    `commitgate serve`; the compiled engine alone compiles and runs expressions."""
    code = (
        "import sys\n"
        "import commitgate.server.cli.main\n"
        "from commitgate.server.policy.expressions import compile_expression\n"
        "assert compile_expression('arguments.n > 1').evaluate({'arguments': {'n': 2}}) is True\n"
        "print(sorted(m for m in ('prompt_toolkit', 'cel.cli') if m in sys.modules))\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert shown.stdout.strip() == "[]", shown.stdout + shown.stderr


def test_an_unknown_layout_of_the_cel_package_falls_back_to_the_package() -> None:
    code = (
        "import importlib.machinery\n"
        "importlib.machinery.EXTENSION_SUFFIXES = ['.no-such-suffix']  # the compiled module is not found\n"
        "from commitgate.server.policy import expressions\n"
        "assert expressions.cel.__name__ == 'cel', expressions.cel\n"
        "print(expressions.compile_expression('arguments.n > 1').evaluate({'arguments': {'n': 2}}))\n"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip() == "True", shown.stdout + shown.stderr
