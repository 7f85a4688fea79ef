"""CEL expressions in the policy: when a call needs a person's approval, what a call spends.

CEL is the expression language of Kubernetes admission policies and Envoy: side-effect free,
always terminating, and small enough for a policy file. The Rust-backed
`common-expression-language` package compiles an expression once (at load) and evaluates it in
about 10 µs; the pure-Python `cel-python` takes about ten times that per evaluation and
resolves names only at run time.

An expression sees four names (docs/policy.md#expressions): `arguments` (the call's arguments
without `idempotency_key` and `confirm_duplicate`), `principal`, `session` and `tool`. Any
other name is refused when the policy is loaded, so a typo is a `policy check` error rather
than a failure on the first call.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

NAMES = ("arguments", "principal", "session", "tool")


def _engine() -> ModuleType:
    """The package's compiled CEL module, loaded without the package itself.

    `import cel` also imports the package's interactive shell (`cel.cli`, with prompt_toolkit and
    more): about 230 ms of every start-up of `commitgate serve`, for nothing a server uses. The
    compiled module is what the package re-exports, so it is loaded alone, under the name the
    package gives it; a layout this does not know falls back to the package as shipped.
    """
    loaded = sys.modules.get("cel.cel")
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("cel")  # finds it without running its __init__
    for directory in (package.submodule_search_locations or []) if package is not None else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(directory) / f"cel{suffix}"
            if path.is_file():
                loader = importlib.machinery.ExtensionFileLoader("cel.cel", str(path))
                spec = importlib.util.spec_from_file_location("cel.cel", path, loader=loader)
                if spec is None:
                    continue
                module = importlib.util.module_from_spec(spec)
                loader.exec_module(module)
                sys.modules["cel.cel"] = module
                return module
    import cel

    return cel


cel = _engine()


class ExpressionFailed(Exception):
    """An expression could not be evaluated for this call (a missing argument, a type mismatch)."""


@dataclass(frozen=True, slots=True)
class Expression:
    """A compiled CEL expression; equal to another when their sources are equal."""

    source: str
    program: Any = field(compare=False, repr=False)

    def evaluate(self, activation: Mapping[str, Any]) -> Any:
        try:
            return self.program.execute(dict(activation))
        except Exception as exc:  # the package raises KeyError, TypeError, RuntimeError, ValueError
            raise ExpressionFailed(f"{self.source!r}: {_reason(exc)}") from exc

    def __str__(self) -> str:
        return self.source


def activation(arguments: Mapping[str, Any], principal: str, session: str, tool: str) -> dict[str, Any]:
    """The names an expression sees for one call."""
    return {"arguments": arguments, "principal": principal, "session": session, "tool": tool}


def compile_expression(source: Any) -> Expression:
    """Compile `source`, or raise ValueError saying what is wrong (pydantic reports it with its place)."""
    if isinstance(source, Expression):
        return source
    if not isinstance(source, str) or not source.strip():
        raise ValueError('must be a CEL expression in a string, e.g. "arguments.amount_cents > 10000"')
    try:
        program = cel.compile(source)
    except Exception as exc:
        raise ValueError(f"is not valid CEL: {_syntax_reason(exc)}") from None
    unknown = sorted(set(program.variables()) - set(NAMES))
    if unknown:
        raise ValueError(
            f"unknown name{'s' if len(unknown) > 1 else ''} {', '.join(repr(n) for n in unknown)} "
            f"in {source!r}: an expression may use {', '.join(NAMES)}"
        )
    return Expression(source, program)


def _syntax_reason(exc: Exception) -> str:
    # The package's message repeats the source; keep the parser's line with the column.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "Syntax error" in line or "ERROR:" in line:
            return line.split("ERROR: <input>:", 1)[-1].split(" expecting ", 1)[0].strip()
    return lines[0] if lines else type(exc).__name__


def _reason(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"the call has no {exc.args[0]!r}"
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return first


# A policy field holding an expression: compiled at load, written back as its source.
CelExpression = Annotated[
    Expression,
    BeforeValidator(compile_expression),
    PlainSerializer(lambda expression: expression.source, return_type=str),
    WithJsonSchema(
        {"type": "string", "description": "A CEL expression over arguments, principal, session, tool."}
    ),
]
