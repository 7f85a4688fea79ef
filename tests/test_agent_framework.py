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

from commitgate.client.keys import by_arguments

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


def assert_readable(text: str) -> None:
    """commitgate's error is plain text, not an `{"error": ...}` object JSON-encoded into a string.

    pydantic-ai wraps a failed result in its own `{"error": "<text>"}` for providers without a native
    error channel; the text inside is commitgate's message (which quotes the earlier result once).
    """
    assert '{\\"error' not in text and "\\\\" not in text, text


@pytest.mark.anyio
async def test_without_commitgate_the_re_issue_charges_twice(example: ModuleType, tmp_path: Path) -> None:
    box = sandbox(example, tmp_path / "plain")
    seen = await example.run_agent(box.plain())
    assert [outcome for outcome, _ in seen.results] == ["success", "success"]
    assert box.charges() == 2


@pytest.mark.anyio
async def test_through_commitgate_it_charges_once_and_the_model_reads_why(
    example: ModuleType, tmp_path: Path
) -> None:
    box = sandbox(example, tmp_path / "guarded")
    seen = await example.run_agent(box.commitgate(), "run-1", calls=3)  # two refusals in one run
    assert box.charges() == 1
    assert [outcome for outcome, _ in seen.results] == ["success", "failed", "failed"]
    for _, text in seen.results[1:]:
        assert_readable(text)
        message = json.loads(text)["error"]  # pydantic-ai's wrapper around commitgate's plain text
        assert message.startswith("[possible_duplicate] Possible duplicate: nothing was executed now.")
        assert "do not call again" in message
        assert "call again with a new idempotency_key and confirm_duplicate: true" in message
        assert json.loads(seen.results[0][1])["charge_id"] in message  # the earlier charge, named


@pytest.mark.anyio
async def test_by_itself_pydantic_ai_ends_the_run_on_the_second_refusal(
    example: ModuleType, tmp_path: Path
) -> None:
    """What the adapter's `tool_error_behavior="failed"` is for: the default counts refusals as retries."""
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UnexpectedModelBehavior
    from pydantic_ai.mcp import MCPToolset

    box = sandbox(example, tmp_path / "default")
    toolset = MCPToolset(box.commitgate(), init_timeout=30)
    agent = Agent(example.scripted_model(example.Transcript(), calls=3), toolsets=[toolset])
    with pytest.raises(UnexpectedModelBehavior, match="exceeded max retries"):
        await agent.run("Charge order 42 for $12.99")
    assert box.charges() == 1


@pytest.mark.anyio
async def test_keys_from_run_id_and_step_replay_a_re_issue_and_a_restarted_run(
    example: ModuleType, tmp_path: Path
) -> None:
    box = sandbox(example, tmp_path / "durable")
    first = await example.run_agent(box.commitgate(), "run-1", example.order_step)
    restarted = await example.run_agent(box.commitgate(), "run-1", example.order_step)
    answers = first.results + restarted.results
    assert [outcome for outcome, _ in answers] == ["success"] * 4
    assert len({text for _, text in answers}) == 1  # the same charge every time
    assert box.charges() == 1
    other_run = await example.run_agent(box.commitgate(), "run-2", by_arguments)
    assert [outcome for outcome, _ in other_run.results] == ["success", "success"]
    assert box.charges() == 2  # a new run is a new action; its re-issue replays its own charge
    assert other_run.results[0] == other_run.results[1]
