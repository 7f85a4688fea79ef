"""Every rule between keys of a policy, in one place (docs/policy.md).

The rules read the raw document, so they still run when some fields fail validation, and each
returns `Problem`s with the location they are about. The template checks (`{arguments.X}`,
`{result.X}` against a tool's input schema) are rules too: `policy check` asks them again once
the tools are built and their schemas known.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from commitgate.server.model.facts import REFERENCE, IdempotencyClass
from commitgate.server.model.outcomes import Outcome, Verdict
from commitgate.server.policy.problems import Problem, toml_key

# `{arguments.X}` / `{result.X}` with nested paths, as the saga and http sources fill them.
_BRACED = re.compile(r"\{([A-Za-z_][A-Za-z0-9_\-]*)((?:\.[A-Za-z0-9_\-]*)*)\}")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
BUDGET_NAME = TOOL_NAME
RESERVED_TOOL_NAMES = frozenset({"get_operation_status", "list_operations", "compensate_session"})
_NOT_IN_A_TOOL_NAME = re.compile(r"[^A-Za-z0-9_.\-]")


def usable_tool_name(name: str) -> bool:
    """Whether a tool may be served under `name` as it is: allowed characters, no meta tool's name."""
    return name not in RESERVED_TOOL_NAMES and TOOL_NAME.fullmatch(name) is not None


SHARED_NAME = "{upstream}__{name}"  # a tool or prompt name two upstreams share, served under each's name


def prefixed_tool_name(prefix: str, name: str) -> str:
    """`PREFIX__NAME` as a tool name: what a name cannot hold becomes `_`, cut to the longest allowed."""
    return _NOT_IN_A_TOOL_NAME.sub("_", SHARED_NAME.format(upstream=prefix, name=name))[:128]


CALL_OUTCOMES = tuple(Outcome)  # what an HTTP status may mean for a call
CHECK_VERDICTS = tuple(Verdict)  # ... and for a status check
HTTP_STATUS_PATTERN = re.compile(r"[1-5](\d\d|xx)")


def raw_tables(value: Any) -> dict[str, dict[str, Any]]:
    """The tables under a key of the raw document, by name; anything else is skipped."""
    return {k: v for k, v in value.items() if isinstance(v, dict)} if isinstance(value, dict) else {}


def _class_of(raw: Mapping[str, Any]) -> IdempotencyClass | None:
    try:
        return IdempotencyClass(str(raw.get("class")))
    except ValueError:
        return None


def cross_field_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Every rule between keys, run on the raw document (after `${ENV}` substitution)."""
    tools = raw_tables(data.get("tools"))
    upstreams = data.get("upstreams") if isinstance(data.get("upstreams"), dict) else {}
    budgets = data.get("budgets") if isinstance(data.get("budgets"), dict) else {}
    problems: list[Problem] = []
    for name in budgets or {}:
        if not BUDGET_NAME.fullmatch(name):
            problems.append(
                Problem(
                    f"budgets.{toml_key(name)}",
                    "budget names are 1-128 characters of letters, digits, '_', '-', '.'",
                )
            )
    for name, raw in tools.items():
        problems += _tool_problems(name, raw, tools, upstreams or {})
        problems += _budget_problems(f"tools.{toml_key(name)}", raw, budgets or {})
    server = data.get("server") if isinstance(data.get("server"), dict) else {}
    return problems + _token_role_problems(data.get("auth"), (server or {}).get("principal"))


def _token_role_problems(auth: Any, stdio_principal: Any) -> list[Problem]:
    """Operators are not agents: an operator's name is no agent's principal, and the principals it
    sees are agents' principals (or "*")."""
    tokens = auth.get("tokens") if isinstance(auth, dict) else None
    if not isinstance(tokens, list):
        return []
    entries = [(i, t) for i, t in enumerate(tokens) if isinstance(t, dict)]
    agents = {t.get("principal") for _, t in entries if t.get("role", "agent") == "agent"}
    known_principals = agents | ({stdio_principal} if isinstance(stdio_principal, str) else set())
    problems: list[Problem] = []
    for i, token in entries:
        if token.get("role") != "operator":
            continue
        where = f"auth.tokens[{i}]"
        name = token.get("principal")
        if name in known_principals:
            problems.append(
                Problem(
                    f"{where}.principal",
                    f"{name!r} is also an agent's principal; an operator's name must differ from every"
                    " agent principal, so that a decision never names the agent it was about",
                )
            )
        seen = token.get("principals")
        if isinstance(seen, list):
            known = ", ".join(sorted(str(a) for a in known_principals if a)) or "none"
            problems += [
                Problem(
                    f"{where}.principals",
                    f"{p!r} is no agent's principal (agents: {known}); name agent principals or"
                    ' "*" for every principal',
                )
                for p in seen
                if p != "*" and p not in known_principals
            ]
    return problems


def _budget_problems(where: str, raw: Mapping[str, Any], budgets: Mapping[str, Any]) -> list[Problem]:
    """`budget = "NAME"` names a declared budget, on a keyed tool (only those are recorded)."""
    name = raw.get("budget")
    if not isinstance(name, str) or not name:
        return []
    problems = []
    if name not in budgets:
        close = difflib.get_close_matches(name, list(budgets), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        declared = f" (declared: {', '.join(map(repr, budgets))})" if budgets and not close else ""
        problems.append(Problem(f"{where}.budget", f"no [budgets.{name}] is declared{hint}{declared}"))
    if _class_of(raw) is IdempotencyClass.SAFE_RETRY:
        problems.append(
            Problem(
                f"{where}.budget",
                "safe-retry tools are not recorded, so nothing could be counted; only keyed tools spend a budget",
            )
        )
    return problems


def _tool_problems(
    name: str, raw: dict[str, Any], tools: dict[str, dict[str, Any]], upstreams: Mapping[str, Any]
) -> list[Problem]:
    where = f"tools.{toml_key(name)}"
    problems = _name_problems(name, where) + _source_problems(where, raw, upstreams)
    problems += _schema_problems(where, raw)
    problems += _class_problems(where, raw)
    if isinstance(raw.get("compensate"), dict):
        problems += _compensation_problems(name, raw, tools)
    if isinstance(raw.get("approval"), dict):
        problems += _approval_problems(where, raw)
    problems += _http_reference_problems(where, raw)
    problems += _http_outcome_problems(where, raw)
    return problems


def _name_problems(name: str, where: str) -> list[Problem]:
    problems = []
    if not TOOL_NAME.fullmatch(name):
        problems.append(Problem(where, "tool names are 1-128 characters of letters, digits, '_', '-', '.'"))
    if name in RESERVED_TOOL_NAMES:
        problems.append(Problem(where, f"{name!r} is the name of a commitgate meta tool; choose another"))
    return problems


def _source_problems(where: str, raw: Mapping[str, Any], upstreams: Mapping[str, Any]) -> list[Problem]:
    problems = []
    sources = [s for s in ("python", "http", "upstream") if raw.get(s) is not None]
    if len(sources) != 1:
        found = " and ".join(sources) or "none"
        problems.append(
            Problem(where, f"needs exactly one source: python, http or upstream (found: {found})")
        )
    upstream = raw.get("upstream")
    if isinstance(upstream, str) and upstream not in upstreams:
        problems.append(Problem(f"{where}.upstream", f"no [upstreams.{upstream}] is declared"))
    if raw.get("upstream_tool") is not None and upstream is None:
        problems.append(Problem(f"{where}.upstream_tool", "only meaningful with `upstream`"))
    return problems


def _class_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    """What the tool's class requires of the rest of its declaration, and what it rules out."""
    cls, problems = _class_of(raw), []
    if cls is IdempotencyClass.KEY_AND_STATUS_CHECK and raw.get("status_check") is None:
        problems.append(Problem(f"{where}.status_check", "class key-and-status-check needs a status_check"))
    if cls is IdempotencyClass.COMPENSABLE and raw.get("compensate") is None:
        problems.append(
            Problem(
                f"{where}.compensate", "class compensable needs compensate = {tool = ..., arguments = {...}}"
            )
        )
    if cls is not None and cls is not IdempotencyClass.COMPENSABLE and raw.get("compensate") is not None:
        problems.append(Problem(f"{where}.compensate", "only tools of class compensable declare compensate"))
    if cls is IdempotencyClass.SAFE_RETRY and raw.get("forwards_key") is True:
        problems.append(Problem(f"{where}.forwards_key", "safe-retry tools take no key to forward"))
    if cls is IdempotencyClass.SAFE_RETRY and raw.get("duplicates") not in (None, False):
        problems.append(
            Problem(
                f"{where}.duplicates",
                "safe-retry tools run again by design; only keyed tools detect duplicates",
            )
        )
    if cls is IdempotencyClass.SAFE_RETRY and raw.get("approval") is not None:
        problems.append(
            Problem(
                f"{where}.approval",
                "safe-retry tools are not recorded, so nothing can wait for a decision; only keyed tools "
                "take an approval",
            )
        )
    return problems


def _approval_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    """The prompt's `{arguments.X}` must name arguments of the tool; `{result.X}` does not exist yet."""
    prompt = raw["approval"].get("prompt")
    if not isinstance(prompt, str):
        return []
    problems: list[Problem] = []
    schema = raw.get("input_schema") if isinstance(raw.get("input_schema"), dict) else None
    for location, root, path in template_references(prompt, f"{where}.approval.prompt", problems):
        if root == "result":
            problems.append(Problem(location, "a prompt is shown before the call runs: only {arguments.X}"))
        elif schema is not None and (missing := missing_path(schema, path)) is not None:
            problems.append(Problem(location, f"the tool has no argument {missing}"))
    return problems


def _http_outcome_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    """A call's overrides name outcomes, a status check's name verdicts; the two are easy to swap."""
    status = raw.get("status_check")
    specs: list[tuple[str, Any, tuple[str, ...]]] = [(f"{where}.http", raw.get("http"), CALL_OUTCOMES)]
    if isinstance(status, dict):
        specs.append((f"{where}.status_check.http", status.get("http"), CHECK_VERDICTS))
    problems: list[Problem] = []
    for spec_where, spec, allowed in specs:
        outcomes = spec.get("outcomes") if isinstance(spec, dict) else None
        if not isinstance(outcomes, dict):
            continue
        for code, value in outcomes.items():
            if not HTTP_STATUS_PATTERN.fullmatch(code):
                problems.append(
                    Problem(
                        f"{spec_where}.outcomes.{toml_key(code)}",
                        "not an HTTP status: write a code like '409' or a class like '5xx'",
                    )
                )
            if (
                value in CALL_OUTCOMES + CHECK_VERDICTS and value not in allowed
            ):  # others: a type error already
                problems.append(
                    Problem(
                        f"{spec_where}.outcomes.{toml_key(code)}",
                        f"{value!r} does not apply here: use one of {', '.join(allowed)}",
                    )
                )
    return problems


def _schema_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    status = raw.get("status_check")
    if raw.get("python") is not None and isinstance(status, Mapping) and status.get("http") is not None:
        return [
            Problem(
                f"{where}.status_check",
                'a python tool\'s status check is python too (`status_check = "module:function"`)',
            )
        ]
    schema = raw.get("input_schema")
    if raw.get("http") is not None and schema is None:
        return [Problem(f"{where}.input_schema", "an http tool needs an input_schema (JSON Schema)")]
    if schema is not None and raw.get("python") is not None:
        return [
            Problem(f"{where}.input_schema", "python tools take their schema from the function's signature")
        ]
    if not isinstance(schema, dict):
        return []
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return [Problem(f"{where}.input_schema", f"not a valid JSON Schema: {exc.message}")]
    if schema.get("type", "object") != "object":
        return [Problem(f"{where}.input_schema.type", 'tool arguments are an object: type = "object"')]
    return []


def _compensation_problems(name: str, raw: dict[str, Any], tools: dict[str, dict[str, Any]]) -> list[Problem]:
    where = f"tools.{toml_key(name)}.compensate"
    spec = raw["compensate"]
    problems: list[Problem] = []
    target_name = spec.get("tool")
    if isinstance(target_name, str):
        target = tools.get(target_name)
        if target is None:
            close = difflib.get_close_matches(target_name, list(tools), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(Problem(f"{where}.tool", f"no tool named {target_name!r} in [tools]{hint}"))
        elif target_name == name:
            problems.append(Problem(f"{where}.tool", "a tool cannot compensate itself"))
        elif _class_of(target) is IdempotencyClass.SAFE_RETRY:
            problems.append(Problem(f"{where}.tool", "a compensating tool must be keyed (not safe-retry)"))
        elif target is not None and isinstance(target.get("input_schema"), dict):
            problems += argument_key_problems(where, spec.get("arguments"), target["input_schema"])
    arguments = spec.get("arguments")
    if isinstance(arguments, dict):
        forward_schema = raw.get("input_schema") if isinstance(raw.get("input_schema"), dict) else None
        for location, root, path in template_references(arguments, f"{where}.arguments", problems):
            if root == "arguments" and forward_schema is not None:
                missing = missing_path(forward_schema, path)
                if missing is not None:
                    problems.append(Problem(location, f"the forward call has no argument {missing}"))
    return problems


def _http_reference_problems(where: str, raw: Mapping[str, Any]) -> list[Problem]:
    schema = raw.get("input_schema")
    if not isinstance(schema, dict):
        return []
    problems: list[Problem] = []
    status = raw.get("status_check")
    for spec_where, spec in ((f"{where}.http", raw.get("http")), (f"{where}.status_check.http", None)):
        if spec is None and isinstance(status, dict):
            spec = status.get("http")
        if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
            continue
        problem = url_argument_problem(spec["url"], schema)
        if problem is not None:
            problems.append(Problem(f"{spec_where}.url", problem))
    return problems


# --- templates against input schemas (`policy check` asks again once tools are built) ----


def url_argument_problem(url: str, schema: Mapping[str, Any]) -> str | None:
    """The first `{arguments.X}` of an HTTP url that the tool's input schema certainly lacks, said
    as `policy check` says it. Sources ask too, for schemas only an upstream knows."""
    for match in REFERENCE.finditer(url):
        if match.group(1) == "arguments":
            missing = missing_path(schema, match.group(2).split(".")[1:])
            if missing is not None:
                return f"input_schema has no argument {missing}"
    return None


def template_references(
    value: Any, location: str, problems: list[Problem]
) -> Iterator[tuple[str, str, list[str]]]:
    """Every `{arguments.X}` / `{result.X}` in a template: (location, root, path); misspelt ones are problems."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from template_references(item, f"{location}.{toml_key(key)}", problems)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from template_references(item, f"{location}[{i}]", problems)
    elif isinstance(value, str):
        for match in _BRACED.finditer(value):
            head, path = match.group(1), match.group(2)
            reference = REFERENCE.fullmatch(match.group(0))
            if reference is not None:
                yield location, reference.group(1), reference.group(2).split(".")[1:]
            elif (
                head in ("arguments", "result")
                or path
                or difflib.get_close_matches(head, ["arguments", "result"], n=1, cutoff=0.75)
            ):
                problems.append(
                    Problem(
                        location,
                        f"bad reference {match.group(0)}: write {{arguments.NAME}} or {{result.NAME}} "
                        "(nested paths like {result.booking.id} are allowed)",
                    )
                )


def missing_path(
    schema: Mapping[str, Any], path: list[str], closed_top: bool = True, exhaustive: bool = False
) -> str | None:
    """The first part of `path` the JSON Schema certainly lacks (quoted), or None if it may exist.

    With `closed_top`, the top level lists every name (tool arguments do); with `exhaustive`,
    every level does (pydantic-validated values keep only the fields they declare).
    """
    root = schema
    node: Mapping[str, Any] = schema
    walked: list[str] = []
    for part in path:
        node = _resolve(root, node)
        walked.append(part)
        properties = node.get("properties")
        if isinstance(properties, dict) and part in properties:
            node = properties[part]
            continue
        items = node.get("items")
        if part.isdigit() and isinstance(items, dict):
            node = items
            continue
        if not isinstance(properties, dict):
            return None
        closed = node.get("additionalProperties", None)
        if closed is False or (closed is None and (exhaustive or (closed_top and len(walked) == 1))):
            return repr(".".join(walked))
        return None
    return None


def _resolve(root: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any]:
    """Follow local `$ref`s (pydantic puts nested models in `$defs`) and single-member anyOf."""
    for _ in range(20):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            target: Any = root
            for part in ref[2:].split("/"):
                target = target.get(part, {}) if isinstance(target, dict) else {}
            node = target
            continue
        options = [o for o in node.get("anyOf", []) if isinstance(o, dict) and o.get("type") != "null"]
        if "properties" not in node and len(options) == 1:
            node = options[0]
            continue
        return node
    return node


def argument_key_problems(where: str, arguments: Any, target_schema: Mapping[str, Any]) -> list[Problem]:
    """Compensation arguments against the compensating tool's schema: unknown and missing names."""
    if not isinstance(arguments, dict):
        return []
    properties = target_schema.get("properties")
    if not isinstance(properties, dict):
        return []
    problems = []
    closed = target_schema.get("additionalProperties") is False or "additionalProperties" not in target_schema
    for key in arguments:
        if key not in properties and key != "idempotency_key" and closed:
            problems.append(
                Problem(f"{where}.arguments.{toml_key(key)}", "the compensating tool has no such argument")
            )
    required = [r for r in target_schema.get("required", []) if r != "idempotency_key"]
    absent = [r for r in required if r not in arguments]
    if absent:
        problems.append(
            Problem(f"{where}.arguments", f"the compensating tool also needs: {', '.join(map(repr, absent))}")
        )
    return problems
