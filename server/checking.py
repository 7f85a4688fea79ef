"""`policy check`: every problem of a policy file, including what only loading the tools reveals."""

from __future__ import annotations

from pathlib import Path

from .policy import PolicyError, Problem, load_policy
from .registry import ToolBuildError, build_tools


def check_policy_file(path: Path) -> list[Problem]:
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        return exc.problems
    try:
        build_tools(policy, path.resolve().parent)
    except ToolBuildError as exc:
        return exc.problems
    return []
