"""A problem in a policy and where it is: the key's location, the line it is written on.

pydantic's errors become problems said in the words of the file, with a suggestion for a misspelt
key or value (`tools.refund.expos: unknown key; did you mean 'expose'?`).
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from commitgate.server.policy.models import Policy


@dataclass(frozen=True, slots=True)
class Problem:
    location: str
    message: str
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        if not self.location:
            where = f"line {self.line}, column {self.column}: " if self.line and self.column else ""
            return f"{where}{self.message}"
        suffix = f" (line {self.line})" if self.line else ""
        return f"{self.location}: {self.message}{suffix}"

    def as_json(self) -> dict[str, Any]:
        return {"location": self.location, "message": self.message, "line": self.line, "column": self.column}


class PolicyError(Exception):
    """Every problem found in a policy; `str()` lists them one per line."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems))


_BARE_KEY = re.compile(r"[A-Za-z0-9_\-]+")


def toml_key(name: str) -> str:
    """A key as written in TOML: bare when it can be, quoted otherwise (`tools."send email"`)."""
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name, ensure_ascii=False)


# --- what pydantic's errors mean in the file ---------------------------------------


def _location(loc: tuple[int | str, ...]) -> str:
    # pydantic reports union members and validator names in loc; keep only the path in the file.
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif "[" in part or part.startswith("function-"):
            continue
        else:
            text += f".{toml_key(part)}" if text else toml_key(part)
    return text


def _got(item: ErrorDetails) -> str:
    value = item.get("input")
    if isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= 40):
        return f" (got {value!r})"
    return ""


# What a value of the wrong type must be, by pydantic's error type.
_MUST_BE = {
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "must be an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "must be a number"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "must be true or false"),
    "string_type": "must be a string",
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), "must be a table"),
    "list_type": "must be an array",
}
_BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")


def _message(item: ErrorDetails) -> str:
    kind, ctx = item["type"], item.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown key" + _suggestion(item["loc"]) + " (see `commitgate policy schema`)"
    if kind == "missing":
        return "required key is missing"
    if kind in _BOUNDS:
        return _bound(kind, ctx) + _got(item)
    if kind in _MUST_BE:
        return _MUST_BE[kind] + _got(item)
    if kind in ("literal_error", "enum"):
        expected = str(ctx.get("expected", "one of the allowed values"))
        return (
            f"must be {expected}"
            + _got(item)
            + _closest(item.get("input"), re.findall(r"'([^']*)'", expected))
        )
    return item["msg"].removeprefix("Value error, ")


def _bound(kind: str, ctx: Mapping[str, Any]) -> str:
    names = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    op, key = names[kind]
    return f"must be {op} {ctx.get(key)}"


def _closest(given: Any, options: list[str]) -> str:
    if not isinstance(given, str):
        return ""
    close = difflib.get_close_matches(given, options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _suggestion(loc: tuple[int | str, ...]) -> str:
    unknown = loc[-1]
    known = _keys_at(loc[:-1])
    if not isinstance(unknown, str) or not known:
        return ""
    close = difflib.get_close_matches(unknown, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _keys_at(loc: tuple[int | str, ...]) -> list[str]:
    """The keys allowed at a location of the file, by walking the models."""
    current: Any = Policy
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = next(
                (f for n, f in current.model_fields.items() if part in (n, f.alias)),
                None,
            )
            if field is None:
                return []
            current = field.annotation
        elif typing.get_origin(current) in (dict, list):
            current = typing.get_args(current)[-1]
        else:
            return []
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or n for n, f in current.model_fields.items()]
    return []


def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
            tp = (models or members)[0]
        else:
            return tp


def pydantic_problems(error: ValidationError, prefix: tuple[str, ...] = ()) -> list[Problem]:
    """pydantic's errors as problems located by their path in the file."""
    return [Problem(_location(prefix + tuple(item["loc"])), _message(item)) for item in error.errors()]


# --- where in the file -------------------------------------------------------------

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_LINE = re.compile(
    r"^\s*((?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'))*)\s*="
)


def _dotted(text: str) -> list[str]:
    return [p.strip().strip("\"'") for p in re.findall(r"\"[^\"]*\"|'[^']*'|[^.]+", text)]


def key_lines(text: str) -> dict[str, int]:
    """Best effort: the line where each table and key of a TOML document is written."""
    lines: dict[str, int] = {}
    table: list[str] = []
    counts: dict[str, int] = {}
    in_string = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.count('"""') % 2 or line.count("'''") % 2:
            in_string = not in_string
            if not in_string:
                continue
        if in_string and '"""' not in line and "'''" not in line:
            continue
        header = _HEADER.match(line)
        if header:
            name = ".".join(toml_key(p) for p in _dotted(header.group(2)))
            if header.group(1) == "[[":
                index = counts.get(name, -1) + 1
                counts[name] = index
                name = f"{name}[{index}]"
            table = [name]
            lines.setdefault(name, number)
            continue
        key = _KEY_LINE.match(line)
        if key:
            path = ".".join([*table, *(toml_key(p) for p in _dotted(key.group(1)))])
            lines.setdefault(path, number)
    return lines


def with_lines(problems: list[Problem], text: str) -> list[Problem]:
    """Attach the line of the nearest written key to each located problem."""
    index = key_lines(text)
    located = []
    for problem in problems:
        line = problem.line
        if line is None and problem.location:
            path = problem.location
            while path and path not in index:
                cut = max(path.rfind("."), path.rfind("["))
                path = path[:cut] if cut > 0 else ""
            line = index.get(path)
        located.append(Problem(problem.location, problem.message, line, problem.column))
    return located
