"""From a policy to the served tools: a tool source per entry, its MCP definition, its guard.

The MCP definition follows the class (docs/contract.md#idempotency-classes): keyed tools get the
required `idempotency_key` argument and one sentence on how to use it, and
their annotations say what kind of action they are. An upstream tool keeps the hints its own
server declared (docs/policy.md#annotations): commitgate never advertises a hint it cannot vouch for.
"""

from __future__ import annotations

import copy
import logging
import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The wire types alone (`mcp.types` mirrors them but imports the whole SDK first): checking a policy
# builds its tools and their definitions without any client or server stack.
import mcp_types as types

from commitgate.server.core.budgets import Budget
from commitgate.server.core.duplicates import add_confirm_property
from commitgate.server.core.requests import GuardedTool
from commitgate.server.model.facts import KEY_CHARACTERS, KEY_MAX_LENGTH, IdempotencyClass
from commitgate.server.policy.models import Policy, ToolPolicy
from commitgate.server.policy.problems import Problem
from commitgate.tools.base import Collaborators, ToolBuildError, ToolSource, build_source

log = logging.getLogger("commitgate.registry")

KEY_PROPERTY: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": KEY_MAX_LENGTH,
    "pattern": f"^{KEY_CHARACTERS}+$",
    "description": (
        "Idempotency key for this action. Choose a new unique value for each new action (e.g. "
        "'refund-order-1234'); when retrying the same action, reuse exactly the same value so it is not done twice."
    ),
}

KEY_SENTENCE = {
    IdempotencyClass.KEY_REQUIRED: (
        "Pass a new idempotency_key for each new action and the same one when retrying it: a retry returns "
        "the first outcome instead of acting twice."
    ),
    IdempotencyClass.KEY_AND_STATUS_CHECK: (
        "Pass a new idempotency_key for each new action and the same one when retrying it; if an answer is "
        "lost, poll get_operation_status with that key instead of calling again."
    ),
    IdempotencyClass.COMPENSABLE: (
        "Pass a new idempotency_key for each new action and the same one when retrying it; if a later step "
        "fails, undo it with compensate_session rather than retrying."
    ),
}

APPROVAL_SENTENCE = (
    "Some calls need a person's approval first: then it answers approval_pending; poll "
    "get_operation_status with the same key and, once approved, call again with the same key and arguments."
)


@dataclass(frozen=True, slots=True)
class ServedTool:
    guard: GuardedTool
    definition: types.Tool
    exposed: bool


def input_schema_for(source_schema: Mapping[str, Any], cls: IdempotencyClass) -> dict[str, Any]:
    schema = copy.deepcopy(dict(source_schema))
    schema.setdefault("type", "object")
    if cls.keyed:
        schema.setdefault("properties", {})["idempotency_key"] = KEY_PROPERTY
        schema["required"] = [
            *[r for r in schema.get("required", []) if r != "idempotency_key"],
            "idempotency_key",
        ]
    return schema


def annotations_for(policy: ToolPolicy, declared: types.Tool | None = None) -> types.ToolAnnotations:
    """The hints of a served tool; `declared` is an upstream tool's own definition, when listed."""
    if policy.upstream is not None:
        return _upstream_annotations(policy, declared.annotations if declared else None)
    if policy.idempotency_class is IdempotencyClass.SAFE_RETRY:
        return types.ToolAnnotations(read_only_hint=True, idempotent_hint=True, destructive_hint=False)
    return types.ToolAnnotations(
        read_only_hint=False, idempotent_hint=True, destructive_hint=policy.destructive
    )


def _upstream_annotations(policy: ToolPolicy, theirs: types.ToolAnnotations | None) -> types.ToolAnnotations:
    """Read-only only when its server says so and it is served unkeyed (a safe-retry entry never makes
    a write look harmless; a keyed class is recorded as an action, so never advertised read-only);
    destructive and open-world as its server says unless the entry sets `destructive`; idempotent for
    keyed tools, since a retry with the same key has no further effect."""
    theirs = theirs or types.ToolAnnotations()
    keyed = policy.idempotency_class.keyed
    read_only = False if keyed else theirs.read_only_hint
    destructive = policy.destructive if "destructive" in policy.model_fields_set else theirs.destructive_hint
    return types.ToolAnnotations(
        title=policy.title or theirs.title,
        read_only_hint=read_only,
        destructive_hint=destructive,
        idempotent_hint=True if keyed else theirs.idempotent_hint,
        open_world_hint=theirs.open_world_hint,
    )


def _sentence_end(text: str) -> str:
    """`text` ending as a sentence, so the key sentence after it reads as a sentence of its own."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else f"{text}."


def definition_for(name: str, policy: ToolPolicy, source: ToolSource) -> types.Tool:
    description = policy.description or source.description or name
    sentence = KEY_SENTENCE.get(policy.idempotency_class)
    if sentence:
        description = f"{_sentence_end(description)} {sentence}"
    if policy.approval is not None and policy.idempotency_class.keyed:
        description = f"{description} {APPROVAL_SENTENCE}"
    declared: types.Tool | None = getattr(source, "declared", None)  # an upstream tool's own definition
    return types.Tool(
        name=name,
        title=policy.title or (declared.title if declared else None),
        description=description,
        input_schema=add_confirm_property(
            input_schema_for(source.input_schema, policy.idempotency_class), policy
        ),
        output_schema=source.output_schema,
        annotations=annotations_for(policy, declared),
        icons=declared.icons if declared else None,
        _meta=declared.meta if declared else None,  # an upstream's own keys (MCP Apps' `ui`) as sent
    )


def importable_beside_policy(policy_dir: Path) -> None:
    """Let `python = "mytools:fn"` name a module next to the policy file.

    The directory goes at the end of the import path, after the standard library and installed
    packages: a stray `resource.py` beside the policy must never replace a module the server
    itself imports. A directory others may write to could still plant the tool modules; say so.
    """
    where = str(policy_dir)
    if where in sys.path:
        return
    sys.path.append(where)
    try:
        mode = os.stat(where).st_mode
    except OSError:
        return
    if mode & (stat.S_IWOTH | stat.S_IWGRP):
        log.warning(
            "the policy directory %s is writable by other users: anyone who can write there can change"
            " the Python tools it imports; make it writable by its owner only (chmod go-w)",
            where,
        )


def _implied(policy: Policy, using: Collaborators) -> dict[str, ToolPolicy]:
    """The tools of `tools = "all"` upstreams that have no entry (none until the upstream is listed)."""
    if not any(spec.tools == "all" for spec in policy.upstreams.values()):
        return {}
    from commitgate.tools.upstream import implied_entries  # imported only by policies that use it

    return implied_entries(policy, using.upstream)


def build_tools(
    policy: Policy,
    policy_dir: Path | None,
    using: Collaborators | None = None,
    reuse: Mapping[str, ToolSource] | None = None,
) -> dict[str, ServedTool]:
    """Every tool of the policy, each with its source (or the one in `reuse`, for a tool that did
    not change); problems are collected, not raised one by one. Without `using`, sources are built
    to be checked, not called."""
    using = using or Collaborators()
    if policy_dir is not None:
        importable_beside_policy(policy_dir)
    served: dict[str, ServedTool] = {}
    problems: list[Problem] = []
    for name, tool_policy in {**policy.tools, **_implied(policy, using)}.items():
        try:
            source = (reuse or {}).get(name) or build_source(name, tool_policy, policy, using)
        except Exception as exc:  # a declaration mistake knows its own place in the file
            field = getattr(exc, "field", None) or tool_policy.source_kind
            location = getattr(exc, "location", None) or f"tools.{name}.{field}"
            problems.append(Problem(location, getattr(exc, "message", None) or str(exc)))
            continue
        if (
            tool_policy.idempotency_class is IdempotencyClass.KEY_AND_STATUS_CHECK
            and not source.has_status_check
        ):
            problems.append(
                Problem(f"tools.{name}.status_check", "the source could not provide a status check")
            )
        declared = policy.budget_of(name)
        budget = Budget(tool_policy.budget, declared) if declared and tool_policy.budget else None
        guard = GuardedTool(name, tool_policy, source, budget)
        served[name] = ServedTool(guard, definition_for(name, tool_policy, source), tool_policy.expose)
    if problems:
        raise ToolBuildError(problems)
    return served
