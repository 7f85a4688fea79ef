"""`policy check`: every problem of a policy file, including what only loading the tools reveals.

The policy models catch what the file alone can tell. Building the tools adds
what only the code can: a `python` reference that does not import, a status
check whose parameters differ from its tool's, compensation arguments the
compensating tool does not take, `{arguments.X}` that the forward call does
not have. The same checks guard a hot reload, so a rejected edit logs exactly
what `check` prints.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter

from commitgate.server.model.facts import IdempotencyClass
from commitgate.server.policy.duplicates import window_warning
from commitgate.server.policy.loading import PolicyReport, analyse_file
from commitgate.server.policy.models import Policy, ToolPolicy
from commitgate.server.policy.problems import Problem, toml_key, with_lines
from commitgate.server.policy.rules import argument_key_problems, missing_path, template_references
from commitgate.server.serve.registry import ServedTool, build_tools
from commitgate.tools.base import ToolBuildError


@dataclass(frozen=True, slots=True)
class Schemas:
    """What a tool's source says about its arguments and results (None: not known without running it)."""

    input_schema: Mapping[str, Any] | None
    output_schema: Mapping[str, Any] | None = None
    exhaustive: bool = False  # values keep only the declared fields (pydantic-validated)


def check_policy_file(path: Path) -> list[Problem]:
    """Every problem of the policy at `path`; empty when it is valid. Never raises for a bad file."""
    return check_report(analyse_file(path), path.resolve().parent)


def check_report(report: PolicyReport, policy_dir: Path | None) -> list[Problem]:
    if report.data is None:  # unreadable or not TOML: nothing more can be checked
        return report.problems
    tools = report.valid_tools()
    whole = report.policy or Policy()
    schemas: dict[str, Schemas] = {}
    problems = list(report.problems)
    for name, tool in tools.items():
        # Each tool is built on its own, so one broken tool does not hide another's problems.
        # Building contacts nothing: http sources open no connection, and upstream sources built
        # without a connection check their declaration only (no upstream server is started).
        try:
            built = build_tools(whole.model_copy(update={"tools": {name: tool}}), policy_dir)
        except ToolBuildError as exc:
            known = {p.location for p in report.problems}  # e.g. a missing status_check, already said
            problems += [p for p in exc.problems if p.location not in known]
            continue
        schemas[name] = schemas_of(built[name])
    problems += source_problems(tools, schemas)
    if report.text is not None:
        problems = sorted(with_lines(problems, report.text), key=lambda p: (p.line is None, p.line or 0))
    return list(dict.fromkeys(problems))


def policy_warnings(path: Path) -> list[str]:
    """What is allowed but likely not meant; `policy check` prints it without failing."""
    policy = analyse_file(path).policy
    if policy is None:
        return []
    warnings = [
        f"upstreams.{toml_key(name)}: {spec.unset_reason}: this upstream cannot start and "
        "its tools answer retryable errors; the other upstreams are served"
        for name, spec in policy.upstreams.items()
        if spec.unset_reason is not None
    ]
    for name, tool in policy.tools.items():
        if tool.idempotency_class.keyed:
            warning = window_warning(f"tools.{toml_key(name)}", tool.duplicates, policy.retention_for(name))
            if warning is not None:
                warnings.append(warning)
    return warnings


def schemas_of(served: ServedTool) -> Schemas:
    source = served.guard.source
    output = getattr(source, "output_schema", None)
    fn = getattr(source, "fn", None)
    if fn is None:
        return Schemas(getattr(source, "input_schema", None), output)
    return Schemas(getattr(source, "input_schema", None), output or _declared_result(fn), exhaustive=True)


def _declared_result(fn: Any) -> dict[str, Any] | None:
    """The JSON Schema of a python tool's return annotation, when it declares a shape."""
    try:
        annotation = typing.get_type_hints(fn).get("return")
    except Exception:
        return None
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(members) == 1:
        annotation = members[0]
    return _shape(annotation)


def _shape(annotation: Any) -> dict[str, Any] | None:
    if typing.is_typeddict(annotation):  # pydantic refuses typing.TypedDict before 3.12
        hints = typing.get_type_hints(annotation)
        return {"type": "object", "properties": {k: _shape(v) or {} for k, v in hints.items()}}
    if isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)
    ):
        try:
            return TypeAdapter(annotation).json_schema()
        except Exception:
            return None
    return None


def served_schemas(served: Mapping[str, ServedTool]) -> dict[str, Schemas]:
    return {name: schemas_of(s) for name, s in served.items()}


def source_problems(tools: Mapping[str, ToolPolicy], schemas: Mapping[str, Schemas]) -> list[Problem]:
    """Compensations checked against the schemas the sources declare."""
    problems: list[Problem] = []
    for name, tool in tools.items():
        spec = tool.compensate
        if tool.idempotency_class is not IdempotencyClass.COMPENSABLE or spec is None:
            continue
        where = f"tools.{toml_key(name)}.compensate"
        target = schemas.get(spec.tool)
        if target is not None and target.input_schema is not None:
            problems += argument_key_problems(where, spec.arguments, target.input_schema)
        forward = schemas.get(name)
        if forward is None:
            continue
        for location, root, path in template_references(spec.arguments, f"{where}.arguments", []):
            if root == "arguments" and forward.input_schema is not None:
                missing = missing_path(forward.input_schema, path, exhaustive=forward.exhaustive)
                if missing is not None:
                    problems.append(Problem(location, f"the forward call has no argument {missing}"))
            elif root == "result" and forward.output_schema is not None:
                missing = missing_path(
                    forward.output_schema, path, closed_top=False, exhaustive=forward.exhaustive
                )
                if missing is not None:
                    problems.append(Problem(location, f"the forward call's result has no {missing}"))
    return problems


def format_report(source: str, problems: list[Problem]) -> str:
    """What `policy check` prints, and what a rejected reload logs."""
    if not problems:
        return f"{source}: OK"
    lines = [f"{source}: {len(problems)} problem(s)", *(f"  {p}" for p in problems)]
    return "\n".join(lines)
