"""A real agent framework end to end: pydantic-ai, a scripted model, MCP over stdio, charges counted.

Runs examples/pydantic_ai_agent.py's scenario (the model re-issues a charge under a new key and
tool-call id after a lost answer) against a plain MCP server and against `commitgate serve`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pydantic_ai_agent.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pydantic_ai_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def sandbox(example: ModuleType, root: Path) -> Any:
    """The example's Sandbox (the example is loaded from its file, so its types are not known here)."""
    root.mkdir()
    return example.Sandbox(root)


@pytest.mark.anyio
async def test_without_commitgate_the_re_issue_charges_twice(example: ModuleType, tmp_path: Path) -> None:
    box = sandbox(example, tmp_path / "plain")
    seen = await example.run_agent(box.plain(), example.model_keys("run-1"))
    assert [outcome for outcome, _ in seen.results] == ["success", "success"]
    assert box.charges() == 2


@pytest.mark.anyio
async def test_through_commitgate_it_charges_once_and_the_model_is_told_why(
    example: ModuleType, tmp_path: Path
) -> None:
    box = sandbox(example, tmp_path / "guarded")
    seen = await example.run_agent(box.commitgate(), example.model_keys("run-1"))
    assert box.charges() == 1
    (first, first_text), (second, second_text) = seen.results
    assert (first, second) == ("success", "failed")  # surfaced to the model as that call's result
    # pydantic-ai gives the model the structured content of an error result, JSON-encoded inside
    # {"error": ...}: the explanation must be (and is) in structuredContent.error.message.
    error = json.loads(json.loads(second_text)["error"])["error"]
    assert error["code"] == "possible_duplicate"
    assert error["duplicate_of"]["result"]["structuredContent"] == json.loads(first_text)
    assert "nothing was executed now" in error["message"]
    assert "do not call again" in error["message"]
    assert "call again with a new idempotency_key and confirm_duplicate: true" in error["message"]


@pytest.mark.anyio
async def test_keys_from_run_id_and_step_replay_a_re_issue_and_a_restarted_run(
    example: ModuleType, tmp_path: Path
) -> None:
    box = sandbox(example, tmp_path / "durable")
    first = await example.run_agent(box.commitgate(), example.durable_keys("run-1"))
    restarted = await example.run_agent(box.commitgate(), example.durable_keys("run-1"))
    answers = first.results + restarted.results
    assert [outcome for outcome, _ in answers] == ["success"] * 4
    assert len({text for _, text in answers}) == 1  # the same charge every time
    assert box.charges() == 1
    other_run = await example.run_agent(box.commitgate(), example.durable_keys("run-2"))
    assert [outcome for outcome, _ in other_run.results] == ["success", "success"]
    assert box.charges() == 2  # a new run is a new action
